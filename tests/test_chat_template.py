"""Chat prompts (`slope_jax.serve.chat`, the HTTP chat route) against transformers' `apply_chat_template` on copies of
the shipped tokenizer with chat templates stored as Hugging Face checkpoints store them: which template (the
chat_template.jinja file over tokenizer_config.json, "tool_use" for a request with tools), the special-token
variables (AddedToken objects, special_tokens_map.json), content given as a list of parts (passed whole to a
template that loops over it, joined for one that prints it), and the option rules transformers and vLLM enforce.
Found by an outside-in probe: each case rendered other text than transformers, silently."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from support import REPO

from slope_jax.kv.store import KVStore
from slope_jax.serve import http
from slope_jax.serve.chat import ChatTemplate, loops_over_content

HD64 = os.path.join(REPO, "checkpoints", "tiny-gpt-oss-hd64")
TURNS = "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
GEN = "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
PARTS = ("{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% else %}"
         "{% for p in m['content'] %}<{{ p.type }}>{{ p.text }}{% endfor %}{% endif %}{% endfor %}")


def _checkpoint(tmp_path, config_extra: dict, files: dict | None = None) -> str:
    """A copy of the hd64 tokenizer files with `config_extra` in tokenizer_config.json and `files` beside it."""
    d = tmp_path / "ck"
    d.mkdir()
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(os.path.join(HD64, name), d / name)
    with open(os.path.join(HD64, "tokenizer_config.json")) as f:
        config = json.load(f)
    config.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps({**config, **config_extra}))
    for name, text in (files or {}).items():
        (d / name).write_text(text)
    return str(d)


def _ours(checkpoint: str, body: dict) -> str:
    """The text the prefill endpoint prefills for a chat body (decoded from its token ids)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    limits = dict(model_name="tiny", vocab_size=tok.get_vocab_size(), max_tokens=4000, tokenizer=tok, seen_ids=set(),
                  top_k=5, kv_store=KVStore(os.path.join(checkpoint, "kv")))
    v = http.validate(json.dumps(body).encode(), {}, 1, chat=True, chat_template=ChatTemplate.find(checkpoint),
                      **limits)
    return tok.decode(v.request.tokens.tolist(), skip_special_tokens=False)


def _transformers(checkpoint: str, body: dict) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    text = tok.apply_chat_template(body["messages"], tools=body.get("tools"), tokenize=False,
                                   add_generation_prompt=body.get("add_generation_prompt", True))
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"], skip_special_tokens=False)


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("case", ["added_token_bos", "special_tokens_map_bos", "jinja_file_first", "tool_use",
                                  "parts_to_a_looping_template", "parts_to_a_printing_template"])
def test_chat_renders_what_transformers_renders(tmp_path, case):
    bos = "{{ bos_token }}" + TURNS + GEN
    body = {"messages": USER}
    if case == "added_token_bos":  # bos_token stored as an AddedToken object: the template saw none
        ck = _checkpoint(tmp_path, {"chat_template": bos, "bos_token": {
            "__type": "AddedToken", "content": "<|startoftext|>", "lstrip": False, "normalized": False,
            "rstrip": False, "single_word": False, "special": True}})
    elif case == "special_tokens_map_bos":  # only in special_tokens_map.json
        ck = _checkpoint(tmp_path, {"chat_template": bos},
                         {"special_tokens_map.json": json.dumps({"bos_token": "<|startoftext|>"})})
    elif case == "jinja_file_first":  # both: transformers and vLLM render the file
        ck = _checkpoint(tmp_path, {"chat_template": "CONFIG" + TURNS}, {"chat_template.jinja": "FILE" + TURNS})
    elif case == "tool_use":  # named templates: "tool_use" when tools are given
        ck = _checkpoint(tmp_path, {"chat_template": [{"name": "default", "template": "DEFAULT" + TURNS},
                                                      {"name": "tool_use", "template": "TOOLS" + TURNS}]})
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    else:
        ck = _checkpoint(tmp_path, {"chat_template": PARTS if case == "parts_to_a_looping_template" else TURNS + GEN})
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                         {"type": "text", "text": "part two"}]}]
    ours = _ours(ck, body)
    if case == "parts_to_a_printing_template":  # transformers would print the list's repr; vLLM joins the parts
        assert ours == "<|start|>user<|message|>part one\npart two<|end|><|start|>assistant"
    else:
        assert ours == _transformers(ck, body), case
    marker = {"added_token_bos": "<|startoftext|>", "special_tokens_map_bos": "<|startoftext|>",
              "jinja_file_first": "FILE", "tool_use": "TOOLS", "parts_to_a_looping_template": "<text>part two"}
    assert marker.get(case, "part two") in ours


def test_chat_refuses_what_transformers_and_vllm_refuse(tmp_path):
    ck = _checkpoint(tmp_path, {"chat_template": TURNS + GEN})
    for extra, param in [({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                         ({"chat_template": "{{ messages }}"}, "chat_template")]:
        with pytest.raises(http.HttpError) as e:
            _ours(ck, {"messages": USER, **extra})
        assert (e.value.status, e.value.param) == (400, param), str(e.value)
    (tmp_path / "n").mkdir()
    named = _checkpoint(tmp_path / "n", {"chat_template": [{"name": "tool_use", "template": TURNS}]})
    with pytest.raises(http.HttpError, match="have no 'default' one"):
        _ours(named, {"messages": USER})


def test_content_loop_detection():
    assert loops_over_content(PARTS)
    assert loops_over_content("{% set msgs = messages[1:] %}{% for m in msgs %}{% for c in m.content | list %}"
                              "{{ c }}{% endfor %}{% endfor %}")
    assert loops_over_content("{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c }}"
                              "{% endfor %}{% endfor %}")
    assert not loops_over_content(TURNS)
    assert not loops_over_content("{% for m in messages %}{% for t in m.tool_calls %}{{ t }}{% endfor %}{% endfor %}")
    assert not loops_over_content("{% for m in messages %")  # does not parse
