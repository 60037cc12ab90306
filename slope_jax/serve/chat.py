"""Chat messages → prompt text: a checkpoint's Hugging Face chat template, found, chosen and rendered as
transformers' `apply_chat_template` does, with the message handling `vllm serve` adds for such templates.

- Finding (`ChatTemplate.find`, transformers 5's order): `chat_template.jinja` in the checkpoint, else `chat_template`
  in tokenizer_config.json (a string, or a list of named templates). Special-token variables (`bos_token`,
  `eos_token`, ...) come from tokenizer_config.json (a string or an AddedToken object's `content`), else from
  special_tokens_map.json, as the tokenizer transformers loads exposes them.
- Choosing: of named templates, "tool_use" when the request gives `tools` and the checkpoint has one, else
  "default" (none: an error, as transformers raises).
- Content given as a list of parts: passed to the template as it is when the template loops over a message's
  content (vLLM's "openai" content format, detected from the template's syntax tree), else its text parts joined
  with newlines (vLLM's "string" format), which is what a template that prints `message.content` expects.
- Options: `add_generation_prompt` and `continue_final_message` may not both be true (transformers raises; vLLM
  answers 400).

Not done (vLLM's renderer does, transformers does not): tool-call `arguments` strings stay strings, a `developer`
role stays `developer`. Through the P/D proxy both engines run the prefill's token ids, so they agree either way.

No JAX here; transformers renders (`render_jinja_template`), jinja2 parses.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from slope_jax.serve import requests

JINJA_FILE = "chat_template.jinja"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM 0.32's ChatCompletionRequest


class ChatError(ValueError):
    """A request the chat template cannot render: the message, and `param`, the request field at fault."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


class ChatTemplate:
    """A checkpoint's chat templates (`templates`: name → Jinja source; one unnamed template is "default") and the
    special-token strings they may use."""

    def __init__(self, source: str | dict[str, str], special_tokens: dict[str, str] | None = None):
        self.templates = {"default": source} if isinstance(source, str) else dict(source)
        self.special_tokens = dict(special_tokens or {})

    @staticmethod
    def find(checkpoint: str | None) -> "ChatTemplate | None":
        """The templates of the checkpoint directory (module doc: the order), or None if it has none."""
        if checkpoint is None:
            return None
        config = _read_json(os.path.join(checkpoint, "tokenizer_config.json"))
        templates: dict[str, str] = {}
        found = config.get("chat_template")
        if isinstance(found, str):
            templates["default"] = found
        elif isinstance(found, list):
            templates = {t["name"]: t["template"] for t in found if isinstance(t, dict)
                         and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        try:
            with open(os.path.join(checkpoint, JINJA_FILE)) as f:
                templates["default"] = f.read()
        except OSError:
            pass
        templates = {k: v for k, v in templates.items() if v}
        return ChatTemplate(templates, _special_tokens(checkpoint, config)) if templates else None

    def choose(self, tools) -> str:
        """The template a request renders with: "tool_use" when it gives tools and there is one, else "default"."""
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatError(f"the checkpoint's chat templates ({', '.join(sorted(self.templates))}) have no 'default' "
                        "one for a request without tools")

    def render(self, messages: list, *, tools=None, **options) -> str:
        """The prompt text of `messages` (transformers' `render_jinja_template`, what `apply_chat_template` renders;
        `options`: add_generation_prompt, continue_final_message, documents, and template kwargs). Raises ChatError
        for messages the chosen template cannot take; other exceptions are the template's own."""
        from transformers.utils.chat_template_utils import render_jinja_template

        source = self.choose(tools)
        messages = _contents(messages, "openai" if loops_over_content(source) else "string")
        rendered, _ = render_jinja_template([messages], chat_template=source, tools=tools,
                                            **{**self.special_tokens, **options})
        return rendered[0]


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _special_tokens(checkpoint: str, config: dict) -> dict[str, str]:
    """`*_token` strings: tokenizer_config.json's, else special_tokens_map.json's; an AddedToken object gives its
    `content` (HF checkpoints store `bos_token` either way)."""
    out: dict[str, str] = {}
    for source in (_read_json(os.path.join(checkpoint, "special_tokens_map.json")), config):
        for key, value in source.items():
            if isinstance(value, dict):
                value = value.get("content")
            if key.endswith("_token") and isinstance(value, str):
                out[key] = value
    return out


def _contents(messages: list, content_format: str) -> list:
    """Each message's list-of-parts content as the template takes it: as it is ("openai"), or its text parts joined
    with newlines ("string"; a part that is not text is refused)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and content_format == "string":
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ChatError(f"'messages'[{i}]: content parts other than text cannot be rendered by this chat "
                                "template")
            content = "\n".join(str(p.get("text", "")) for p in content)
        out.append({**m, "content": content})
    return out


@functools.lru_cache(maxsize=32)  # a server renders with one or two templates: parsed once each
def loops_over_content(source: str) -> bool:
    """Whether a Jinja template iterates over a message's content (`{% for part in message['content'] %}`, through
    filters, tests and slices, or over a variable named `content` outside a macro), where the message is a loop
    variable over `messages` or over a variable set from it. A template that does not parse counts as not looping."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment().parse(source)
    except jinja2.TemplateError:
        return False

    def strip(node):  # message.content|trim, messages[1:], content is string ... → the accessed node
        while isinstance(node, (nodes.Filter, nodes.Test)) or (
                isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
            node = node.node
        return node

    def names(node) -> str | None:
        node = strip(node)
        return node.name if isinstance(node, nodes.Name) else None

    def field_of(node, key: str) -> str | None:  # X['key'] or X.key → X's name
        node = strip(node)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            return names(node.node)
        if isinstance(node, nodes.Getattr) and node.attr == key:
            return names(node.node)
        return None

    lists = {"messages"}
    for assign in tree.find_all(nodes.Assign):  # {% set loop_messages = messages[1:] %}, chained
        if isinstance(assign.target, nodes.Name) and names(assign.node) in lists:
            lists.add(assign.target.name)
    loops = list(tree.find_all(nodes.For))
    message_vars = {loop.target.name for loop in loops
                    if isinstance(loop.target, nodes.Name) and names(loop.iter) in lists}
    in_macros = {id(loop) for macro in tree.find_all(nodes.Macro) for loop in macro.find_all(nodes.For)}
    return any(field_of(loop.iter, "content") in message_vars
               or (names(loop.iter) == "content" and id(loop) not in in_macros) for loop in loops)


def template_kwargs(obj: dict[str, Any], options: dict) -> dict:
    """The chat template's variables as `vllm serve` builds them (ChatCompletionRequest.build_chat_params):
    `chat_template_kwargs`, overridden by add_generation_prompt, continue_final_message, `documents` and
    `reasoning_effort` where these are set (gpt-oss's template reads `reasoning_effort`), and `enable_thinking` =
    effort != "none" when an effort is given and `chat_template_kwargs` does not set it. ChatError naming
    `reasoning_effort` for a value vLLM refuses."""
    effort = obj.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ChatError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)} (or null), got "
                        f"{requests._short(effort)}", "reasoning_effort")
    user = obj.get("chat_template_kwargs") or {}
    extra = {**options, "documents": obj.get("documents"), "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in user:
        extra["enable_thinking"] = effort != "none"
    merged = user | {k: v for k, v in extra.items() if v is not None and v != "auto"}
    merged.pop("tools", None)  # passed on its own
    return merged
