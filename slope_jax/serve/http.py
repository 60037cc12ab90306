r"""The prefill endpoint of a prefill/decode (P/D) deployment: an OpenAI-style completions route on the coordinator
(process 0), feeding the launcher's SLO scheduler like the stdin/file reader does (`slope-jax --http_port=PORT`).

    POST /v1/completions   {"prompt": "It was the best" | [ids...], "max_tokens": 1, "ttft_slo_ms": 500,
                            "logprobs": 2, "request_id": "doc-17", "model": NAME}
      200: an OpenAI completion whose one choice is the first token (text, token_ids, logprobs if asked), plus
           ttft_ms / queue_ms / compute_ms / compile_ms / export_ms / predicted_ttft_ms (the scheduler's cost model;
           prediction_note when the TTFT is more than 25 % from it) and `kv_transfer_params` for the decode side's
           connector (`slope_jax.kv.vllm_connector`):
           {"slope_jax_kv_path": absolute export directory, "slope_jax_first_token": int, "num_tokens": int,
            "token_ids_sha256": `slope_jax.kv.format.token_hash(ids)`, "slope_jax_nixl": {...}}. The path is
           process 0's (a decode server that sees the same filesystem may read it); "slope_jax_nixl" is the NIXL
           hand-off record (`slope_jax.kv.nixl_transport.KVPool.publish`: agent, metadata, address, per-layer
           offsets and XXH3-128 digests, manifest): the same KV, copied into process 0's registered pool
           ($SLOPE_JAX_KV_POOL_GIB, default 1 GiB; lease $SLOPE_JAX_KV_LEASE_S, default 60 s) and pulled by the
           decode side over NIXL (UCX) without a shared filesystem; `publish_ms` says what the copy took. This answer
           goes out as soon as the first token is on the host, before the export is written (`"export_pending":
           true`, `"publish_from": "memory"`; under several processes each process's rows stay in its own pool and
           the record names every pool, `nixl_transport.compose`, `serve.peer_rows`: the decode side pulls each
           piece from the process that computed it; the record's manifest is the one the export will have, less its
           file checksums). Absent if
           NIXL is not installed, the pool is off (0 GiB) or full of held entries, and unless the request's
           kv_transfer_params say {"do_remote_decode": true} (a P/D proxy's: the KV goes to a remote decoder) without
           "slope_jax_transport": "files".
      400: the request breaks a rule; `error.param` names the field and `error.message` the rule (the launcher's
           request boundary, `slope_jax.serve.requests`, unchanged: same checks, same messages).
      404: `model` is not the served model.  409: the request id's export exists (the launcher's --overwrite).
      503: rejected by SLO admission (`--slo_policy=reject`): the message gives predicted vs allowed TTFT.
      500: the boundary accepted it but the engine could not serve it (its bucket does not fit device memory, or
           the prefill failed); the message says which.
    POST /v1/chat/completions   {"messages": [{"role": "user", "content": "..."}], ...}: the same, for the
           checkpoint's chat template (below); the answer has OpenAI's chat shape, and its kv_transfer_params also
           hold "prompt_token_ids" (the rendered prompt's ids, which vLLM's chat route takes instead of rendering).
    POST /v1/kv/release   {"request_id": id}: the decode side is done with that export (the P/D proxy calls it):
           its pool entry is freed unless a reader holds it, and the file export is removed, unless it holds
           prefix-reuse blocks (then it stays as the prefill's cache for later
           prompts sharing its prefix, under --kv_dir_max_gib / --kv_dir_max_age_h retention). 404: not an id this
           server answered.
    GET /v1/kv/pool  the NIXL pool's capacity_bytes, used_bytes, entries, held (readers pulling now), lease_s (process
                     0's pool); under several processes "peers": {process: the same of its pool, age_s (seconds
                     since it posted them, about 1 when live)} for the pools holding the others' shares.
    GET /health  200 once the engine is loaded (the server starts after that).    GET /v1/models  the served model.

Body fields. `prompt`: a non-empty string (tokenized with the checkpoint's tokenizer.json by the boundary's rule:
special-token strings such as "<|endoftext|>" become the control token, nothing is prepended), a non-empty list of
token ids (a whole-number float such as 10.0 is that id, as vLLM reads it; 10.5 is refused), or a list holding
exactly one of those. `truncate_prompt_tokens` (null, or an integer >= -1 and at most --max_tokens) and
`truncation_side` ("left", the default: keep the last tokens; "right": the first; or null): vLLM's truncation,
applied after tokenization (chat too), so the export holds exactly the tokens vLLM keeps; -1 keeps --max_tokens
less one (vLLM: its max model length less one); 0 is refused (nothing would be left). `max_tokens` /
`max_completion_tokens`: absent or 1 — this server produces the first token only; the decode server makes the
rest (`slope_jax.serve.pd_proxy` sends the same request there). `logprobs`: null or 0..--top_k top log-probabilities of
the first position (OpenAI's legacy shape; `top_logprobs` keys are token ids as strings: distinct tokens can decode to
the same text). `ttft_slo_ms`: finite number > 0 (default --ttft_slo_ms). `request_id` (or header X-Request-Id): names
the KV export directory, the boundary's id rule, unique within the run; default "cmpl-<32 hex>". `model`: absent or the
served name (--http_model_name). `stream`, `echo`: absent or false; `n`, `best_of`: absent or 1. `kv_transfer_params`:
the P/D proxy's {"do_remote_decode": true, ...}: with do_remote_decode the KV is also published in the NIXL pool, unless
"slope_jax_transport" is "files" (the export file is always written). `cache_salt`: the
tenant whose prefix cache the prompt may use and whose export it is. Every other field (sampling options, structured
outputs, `prompt_logprobs`, ...) shapes decoding only and is ignored, as vLLM ignores fields it does not know: the
prefill's own first token is always greedy (argmax), and the decode engine recomputes the last prompt position and
samples its first token itself. Chat: `messages` (role and string or text-part content), `add_generation_prompt`
(default true), `continue_final_message`, `tools`, `documents`, `chat_template_kwargs` render the checkpoint's Hugging
Face chat template as transformers' `apply_chat_template` does (`slope_jax.serve.chat`) to text, which is tokenized
like a text prompt; a checkpoint without a template answers 400 naming `messages`. `text_literal` (with a string
`prompt`): special-token strings as plain text, as in request lines.

Library: aiohttp, server and client in one well-kept package (the proxy uses both). vLLM itself serves with FastAPI
on uvicorn, and its P/D example proxies use httpx or aiohttp; the wire format is what matters, and it is OpenAI's.

Threads: aiohttp serves on its own event loop thread; the handler has the body validated on a small thread pool (JSON,
chat template and tokenization never run on the event loop, and the tokenizer releases the GIL: a 12 MB body does
not hold other requests), queues one request line `{"id", "tokens", "ttft_slo_ms", "cache_salt"}` with its arrival
time for the launcher's loop (`get`, the `batching.LineReader` contract), and waits for the record the loop emits for
that id (`deliver`), which becomes the HTTP answer. A client that disconnects cancels its handler: a request the
loop has not started computing is cancelled (its result record says `"cancelled": true`; nothing is computed); one
already in a batch is computed (a batch is not unpicked), and its export is reclaimed as if released. The loop
itself (admission, batching, compute on every process, export, result records) is unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import queue
import sys
import threading
import time
import uuid
from typing import Any, Callable

from absl import logging

from slope_jax.kv import format as kvfmt
from slope_jax.serve import chat as chat_lib
from slope_jax.serve import requests
from slope_jax.serve.chat import ChatTemplate

# The fields this endpoint reads (and checks). Any other field of an OpenAI / vLLM request (sampling options, structured
# outputs, `prompt_logprobs`, ...) shapes decoding only: it is ignored here, as vLLM ignores fields it does not know (a
# P/D proxy may forward a client's whole body), and named in the log.
TRANSPORT_PARAM = "slope_jax_transport"  # kv_transfer_params.slope_jax_transport="files": no NIXL publication
POOL_GIB_ENV, LEASE_ENV = "SLOPE_JAX_KV_POOL_GIB", "SLOPE_JAX_KV_LEASE_S"
_FIELDS = frozenset({"prompt", "model", "max_tokens", "max_completion_tokens", "logprobs", "ttft_slo_ms",
                     "request_id", "stream", "echo", "n", "best_of", "kv_transfer_params", "cache_salt",
                     "truncate_prompt_tokens", "truncation_side", "text_literal"})
_CHAT_FIELDS = frozenset({"messages", "model", "max_tokens", "max_completion_tokens", "ttft_slo_ms", "request_id",
                          "stream", "n", "kv_transfer_params", "cache_salt", "add_generation_prompt",
                          "continue_final_message", "chat_template_kwargs", "tools", "documents",
                          "truncate_prompt_tokens", "truncation_side", "reasoning_effort"})
_ID_LOCK = threading.Lock()  # id reservations: validations run on several threads (`HttpIntake`)


class HttpError(Exception):
    """An HTTP error answer: `status`, the message, and `param` (the body field at fault, or None)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error", 500: "server_error",
                503: "slo_rejected"}


NIXL_UNAVAILABLE = "slope_jax_nixl_unavailable"  # kv_transfer_params: why a NIXL request's KV goes by files
MAX_BODY_BYTES = 64 * 2**20  # the largest request body (a 128K-token prompt is ~1 MB as JSON ids): larger, 413


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape (as vLLM answers): {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param,
                      "code": status}}


class Validated:
    """A completion request that passed every check here: `line` is the request line for the launcher's loop;
    `ignored` the body's fields this endpoint does not read; `chat`: it came by /v1/chat/completions."""

    def __init__(self, request: requests.Request, logprobs: int | None, ignored: list[str] = (), chat: bool = False):
        self.request, self.logprobs, self.ignored, self.chat = request, logprobs, list(ignored), chat
        self.nixl = False  # publish its KV in the NIXL pool too (`validate`: do_remote_decode, not "files")
        self.id = request.id
        self.line = json.dumps({"id": request.id, "tokens": request.tokens.tolist(),
                                **({} if request.ttft_slo_ms is None else {"ttft_slo_ms": request.ttft_slo_ms}),
                                **({} if request.cache_salt is None else {"cache_salt": request.cache_salt})})


class _Unlocked:
    """The tokenizer as the boundary sees it, safe to share between threads and never holding the GIL while it
    works: `encode` is `encode_batch` of one text, which releases the GIL during the Rust code (`encode` holds it:
    tokenizing 3 MB of text here stopped every other Python thread, the server's event loop included, for 2.7 s);
    `encode_special_tokens` (set by the boundary around each call: `text_literal`) is this wrapper's own, so the shared
    tokenizer is never written to: a literal text goes to a copy of it made once with the flag set (`_literal`)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encode_special_tokens = False

    def encode(self, text: str):
        return (_literal(self._tokenizer) if self.encode_special_tokens else self._tokenizer).encode_batch([text])[0]


_LITERAL: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) → (it, its copy encoding special-token strings as text)
_LITERAL_LOCK = threading.Lock()


def _literal(tokenizer):
    """A copy of `tokenizer` with `encode_special_tokens` set (made once per tokenizer, never changed after)."""
    with _LITERAL_LOCK:
        held = _LITERAL.get(id(tokenizer))
        if held is None or held[0] is not tokenizer:
            copy = type(tokenizer).from_str(tokenizer.to_str())
            copy.encode_special_tokens = True
            held = _LITERAL[id(tokenizer)] = (tokenizer, copy)
        return held[1]


def _param_of(message: str) -> str:
    """The HTTP field a boundary message is about. The id's format and uniqueness are checked before the boundary
    runs, so the boundary can only fault the prompt, `ttft_slo_ms` or `cache_salt` (named in quotes)."""
    for field in ("ttft_slo_ms", "cache_salt"):
        if f"'{field}'" in message:
            return field
    return "prompt"


def validate(body: bytes, headers: dict, number: int, *, model_name: str, vocab_size: int, max_tokens: int,
             tokenizer, seen_ids: set[str], top_k: int, kv_store, arrival: float | None = None, chat: bool = False,
             chat_template: "ChatTemplate | None" = None) -> Validated:
    """Check one POST /v1/completions (or, `chat`, /v1/chat/completions) body. Raises HttpError naming the field and
    the rule. Safe to call from several threads at once (the id reservation is locked; the tokenizer is only read).

    Args:
      body: the raw body (UTF-8 JSON object). headers: request headers (for X-Request-Id).
      number: 1-based count of completion requests received (messages say "request N (id): ...").
      model_name: the served model name. vocab_size, max_tokens, tokenizer: the boundary's limits and tokenizer
        (`tokenizers.Tokenizer` or None; used through `_Unlocked`).
      seen_ids: ids used so far in this run (updated; the boundary's uniqueness rule).
      top_k: the most `logprobs` a request may ask for (--top_k). kv_store: the owner of the export directory's
        policy (`slope_jax.kv.store.KVStore`): its `check_new` refuses an id whose export exists (409).
      arrival: perf_counter() seconds of the request's arrival (default now).
      chat_template: the checkpoint's chat template (`ChatTemplate.find`), None if it has none (chat: 400).
    """
    obj = _decode_body(body, number)
    where = f"request {number}"
    fields = _CHAT_FIELDS if chat else _FIELDS
    _check_model(obj, where, model_name)
    _check_first_token_only(obj, where, fields)
    logprobs = _check_answer_options(obj, where, top_k, chat)
    keep = _truncation(obj, where, max_tokens)
    rid, param_id = _request_id(obj, headers, where)
    _reserve(rid, seen_ids, where, param_id)
    line = {"id": rid, **{k: obj[k] for k in ("ttft_slo_ms", "cache_salt") if obj.get(k) is not None}}
    line.update(chat_prompt(obj, where, tokenizer, chat_template) if chat else _prompt_field(obj, where, tokenizer))
    try:  # a prompt to be truncated may be longer than the limit: the truncated one is at most the limit
        req = requests.parse(json.dumps(line), number, vocab_size=vocab_size,
                             max_tokens=max_tokens if keep is None else sys.maxsize,
                             tokenizer=None if tokenizer is None else _Unlocked(tokenizer), seen_ids=None,
                             arrival=arrival, label="request")
    except requests.LineError as e:
        message = str(e).replace("'tokens'", "'prompt'").replace("'text'", "'prompt'")
        param = _param_of(message)
        raise HttpError(400, message, "messages" if chat and param == "prompt" else param) from e
    if keep is not None and len(req.tokens) > keep[0]:  # vLLM's slice: the last N tokens ("left") or the first N
        req.tokens = req.tokens[-keep[0]:] if keep[1] == "left" else req.tokens[:keep[0]]
    try:
        kv_store.check_new(req.id)
    except kvfmt.ExportExistsError as e:
        raise HttpError(409, f"{where} ({req.id}): {e}", param_id) from e
    v = Validated(req, logprobs, sorted(set(obj) - fields), chat)
    ktp = obj.get("kv_transfer_params") or {}  # a P/D proxy's: the KV goes to a remote decoder
    v.nixl = bool(ktp.get("do_remote_decode")) and ktp.get(TRANSPORT_PARAM, "nixl") != "files"
    return v


def _reserve(rid: str, seen_ids: set[str], where: str, param_id: str) -> None:
    """Take `rid` for this run (ids name KV directories): HttpError 400 if an earlier request has it."""
    with _ID_LOCK:
        if rid in seen_ids:
            raise HttpError(400, f"{where}: duplicate id {rid!r} (ids name KV directories and must be unique; the "
                            "first request with this id keeps it)", param_id)
        seen_ids.add(rid)


def _decode_body(body: bytes, number: int) -> dict:
    """The body as a JSON object (HttpError 400: not UTF-8, not strict JSON, not an object)."""
    try:
        obj = requests.loads_strict(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise HttpError(400, f"request {number}: the body is not valid UTF-8 (offset {e.start})") from e
    except (ValueError, RecursionError) as e:
        raise HttpError(400, f"request {number}: the body is not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise HttpError(400, f"request {number}: the body must be a JSON object, got {type(obj).__name__}")
    return obj


def _check_model(obj: dict, where: str, model_name: str) -> None:
    """`model`, when given, is the served one (404; 400 if not a string)."""
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise HttpError(400, f"{where}: 'model' must be a string, got {type(model).__name__}", "model")
    if model is not None and model != model_name:
        raise HttpError(404, f"{where}: model {requests._short(model)} is not served here; this server serves "
                        f"{model_name!r}", "model")


def _check_first_token_only(obj: dict, where: str, fields: frozenset) -> None:
    """The fields that would ask for more than one greedy first token in one body: max_tokens /
    max_completion_tokens 1, stream / echo false, n / best_of 1 (each may be absent; only the route's `fields`)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = obj.get(name)
        if name in fields and value is not None and (isinstance(value, bool) or value != 1):
            raise HttpError(400, f"{where}: '{name}' must be 1 (or absent), got {requests._short(value)}: the "
                            "prefill endpoint produces the first token only; send the request to the decode server "
                            "for the rest (slope_jax.serve.pd_proxy does both)", name)
    for name in ("stream", "echo"):
        if name in fields and obj.get(name) is not None and obj[name] is not False:
            raise HttpError(400, f"{where}: '{name}' must be false (or absent), got {requests._short(obj[name])}: "
                            "the prefill endpoint answers with one JSON body holding the first token", name)
    for name in ("n", "best_of"):
        if name in fields and (obj.get(name) not in (None, 1) or isinstance(obj.get(name), bool)):
            raise HttpError(400, f"{where}: '{name}' must be 1 (or absent), got {requests._short(obj[name])}: one "
                            "greedy first token per request", name)


def _check_answer_options(obj: dict, where: str, top_k: int, chat: bool) -> int | None:
    """`logprobs` (completions: an integer in [0, top_k] or null; returned) and `kv_transfer_params` (an object or
    null)."""
    logprobs = None if chat else _whole(obj.get("logprobs"))
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= top_k):
        raise HttpError(400, f"{where}: 'logprobs' must be an integer in [0, {top_k}] (--top_k) or null, got "
                        f"{requests._short(logprobs)}", "logprobs")
    ktp = obj.get("kv_transfer_params")
    if ktp is not None and not isinstance(ktp, dict):
        raise HttpError(400, f"{where}: 'kv_transfer_params' must be an object or null, got "
                        f"{type(ktp).__name__}", "kv_transfer_params")
    return logprobs


def _whole(value):
    """An integer field's value as vLLM's request models read it (pydantic's lax mode): a whole-number float is that
    integer (2.0 → 2); anything else unchanged, for the field's own check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _truncation(obj: dict, where: str, max_tokens: int) -> tuple[int, str] | None:
    """vLLM's `truncate_prompt_tokens` and `truncation_side` (its TokenizeParams, applied after tokenization):
    (how many tokens of the prompt to keep, the side cut: "left" keeps the last ones, vLLM's default for generate
    models; "right" the first ones), or None (null or absent: no truncation). -1 keeps `max_tokens` (--max_tokens,
    this server's max model length) less one, held back for generation. HttpError 400 naming the field: not an
    integer >= -1, more than `max_tokens`, 0 (nothing of the prompt would be left), a side other than 'left' /
    'right'."""
    keep, side = _whole(obj.get("truncate_prompt_tokens")), obj.get("truncation_side")
    if side is not None and side not in ("left", "right"):
        raise HttpError(400, f"{where}: 'truncation_side' must be 'left' or 'right' (or null), got "
                        f"{requests._short(side)}", "truncation_side")
    if keep is None:
        return None
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < -1:
        raise HttpError(400, f"{where}: 'truncate_prompt_tokens' must be an integer >= -1 (or null), got "
                        f"{requests._short(keep)}", "truncate_prompt_tokens")
    if keep > max_tokens:
        raise HttpError(400, f"{where}: 'truncate_prompt_tokens' must be at most {max_tokens} (--max_tokens, the "
                        f"longest prompt served), got {keep}", "truncate_prompt_tokens")
    if keep == 0 or (keep == -1 and max_tokens <= 1):
        raise HttpError(400, f"{where}: 'truncate_prompt_tokens' is {keep}: nothing of the prompt would be left",
                        "truncate_prompt_tokens")
    return (max_tokens - 1 if keep == -1 else keep), side or "left"


def _request_id(obj: dict, headers: dict, where: str) -> tuple[str, str]:
    """(id, the field it came from): `request_id`, else the X-Request-Id header, else a fresh "cmpl-<uuid>";
    HttpError 400 when its format breaks the id rule (`requests.check_request_id`)."""
    header = next((v for k, v in headers.items() if k.lower() == "x-request-id"), None)  # names are case-insensitive
    rid = obj.get("request_id", header)
    param_id = "request_id" if "request_id" in obj else "X-Request-Id"
    if rid is None:
        rid = f"cmpl-{uuid.uuid4().hex}"
    try:
        requests.check_request_id(rid, where)
    except requests.RequestError as e:
        raise HttpError(400, str(e), param_id) from e
    return rid, param_id


def _prompt_field(obj: dict, where: str, tokenizer) -> dict:
    """`prompt` → the boundary's "text" or "tokens" field (the boundary then checks its content)."""
    if "prompt" not in obj:
        raise HttpError(400, f"{where}: missing field 'prompt' (a string or a list of token ids)", "prompt")
    prompt = obj["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (list, str)) for p in prompt):
        if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
            raise HttpError(400, f"{where}: 'prompt' mixes text and token-id lists; a list of prompts holds strings "
                            "only or token-id lists only", "prompt")
        if len(prompt) != 1:
            raise HttpError(400, f"{where}: 'prompt' holds {len(prompt)} prompts; the prefill endpoint takes one per "
                            "request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None and prompt:
            raise HttpError(400, f"{where}: 'prompt' is text, and the checkpoint has no tokenizer.json; send token "
                            "ids instead", "prompt")
        literal = obj.get("text_literal", False)  # the request lines' option: special-token strings as plain text
        return {"text": prompt, **({"text_literal": literal} if literal is not False else {})}
    if not isinstance(prompt, list):
        raise HttpError(400, f"{where}: 'prompt' must be a string or a list of token ids, got "
                        f"{type(prompt).__name__}", "prompt")
    # a whole-number float is that token id, as vLLM reads it (pydantic's lax mode); 10.5 stays, for the boundary's
    # "token ids must be integers" naming 'prompt'
    return {"tokens": [int(t) if isinstance(t, float) and t.is_integer() else t for t in prompt]}


def chat_prompt(obj: dict, where: str, tokenizer, template: ChatTemplate | None) -> dict:
    """`messages` (and the template options) → the boundary's "text": the checkpoint's chat template rendered as
    transformers' `apply_chat_template` renders it (`slope_jax.serve.chat`: which template, special tokens, content
    parts), then tokenized without adding special tokens, as `vllm serve` does. HttpError 400 naming the field: no
    chat template, no tokenizer, a request's own `chat_template`, malformed messages or options."""
    if template is None:
        raise HttpError(400, f"{where}: the checkpoint has no chat template ('chat_template' in tokenizer_config.json "
                        "or chat_template.jinja), so its messages cannot be turned into a prompt here; send "
                        "/v1/completions with the formatted prompt, or serve a checkpoint that has one", "messages")
    if tokenizer is None:
        raise HttpError(400, f"{where}: the checkpoint has no tokenizer.json to tokenize the chat prompt with",
                        "messages")
    if obj.get("chat_template") is not None:  # vLLM too refuses it unless started with --trust-request-chat-template
        raise HttpError(400, f"{where}: 'chat_template': this endpoint renders the checkpoint's chat template only "
                        "(the P/D proxy sends a request with its own template to vLLM whole)", "chat_template")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, f"{where}: 'messages' must be a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        parts = isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                                  for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not (
                parts or isinstance(content, (str, type(None)))):
            raise HttpError(400, f"{where}: 'messages'[{i}] must be an object with a string 'role' and a string (or "
                            "a list of content parts) 'content'", "messages")
    options = {"add_generation_prompt": obj.get("add_generation_prompt", True),
               "continue_final_message": obj.get("continue_final_message", False)}
    for name, value in options.items():
        if not isinstance(value, bool):
            raise HttpError(400, f"{where}: '{name}' must be true or false, got {requests._short(value)}", name)
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise HttpError(400, f"{where}: 'continue_final_message' and 'add_generation_prompt' cannot both be true "
                        "(the final message is either continued or followed by a new assistant turn)",
                        "continue_final_message")
    for name, kind in (("tools", list), ("documents", list), ("chat_template_kwargs", dict)):
        if obj.get(name) is not None and not isinstance(obj[name], kind):
            raise HttpError(400, f"{where}: '{name}' must be {'a list' if kind is list else 'an object'} or null",
                            name)
    try:
        text = template.render(messages, tools=obj.get("tools"), **chat_lib.template_kwargs(obj, options))
    except chat_lib.ChatError as e:
        raise HttpError(400, f"{where}: {e}", e.param) from e
    except Exception as e:  # noqa: BLE001 - the template's own error (raise_exception, a missing key) is the client's
        raise HttpError(400, f"{where}: the chat template failed on these messages ({type(e).__name__}: "
                        f"{str(e)[:200]})", "messages") from e
    return {"text": text}


def completion_body(record: dict, validated: Validated, model_name: str) -> tuple[int, dict]:
    """The HTTP status and body for the launcher's record of a validated request (see the module docstring)."""
    rid = validated.id
    if "error" in record:
        message = record["error"]
        prefix = f"line {record.get('line')} ({rid}): "  # the loop's own line count means nothing to an HTTP client
        message = f"request ({rid}): {message[len(prefix):]}" if message.startswith(prefix) else message
        status = 503 if record.get("rejected") else 500
        return status, error_body(status, message, "ttft_slo_ms" if status == 503 else None)
    first = record["first_token"]
    text = record.get("first_token_text", "")
    logprobs = None
    if validated.logprobs is not None:
        # top_k holds logits; log-softmax needs the log-sum-exp: lse = logit(first) - logprob(first)
        logits = dict(record["top_k"])
        lse = logits[first] - record["logprob"]
        top = record["top_k"][:validated.logprobs]
        logprobs = {"tokens": [text], "token_logprobs": [record["logprob"]], "text_offset": [0],
                    "top_logprobs": [{str(t): round(v - lse, 6) for t, v in top}] if validated.logprobs else [None]}
    tokens = validated.request.tokens
    body: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
        "choices": [{"index": 0, "text": text, "token_ids": [first], "logprobs": logprobs, "finish_reason": "length",
                     "stop_reason": None}],
        "usage": {"prompt_tokens": int(tokens.size), "completion_tokens": 1, "total_tokens": int(tokens.size) + 1,
                  "prompt_tokens_details": {"cached_tokens": int(record.get("cached_tokens", 0))}},
        "kv_transfer_params": {"slope_jax_kv_path": os.path.abspath(record["kv_path"]),
                               "slope_jax_first_token": first, "num_tokens": record["num_tokens"],
                               "token_ids_sha256": kvfmt.token_hash(tokens)},
    }
    for key in ("ttft_ms", "queue_ms", "compute_ms", "compile_ms", "export_ms", "predicted_ttft_ms",
                "prediction_note", "ttft_slo_ms", "slo_met", "late"):
        if key in record:
            body[key] = record[key]
    if validated.chat:
        # OpenAI's chat shape; the prompt's token ids ride along for the decode server (vLLM reads
        # kv_transfer_params.prompt_token_ids of a chat request instead of rendering its own template: both engines
        # then run the same tokens whatever each would render, e.g. vLLM's Harmony encoder for gpt-oss)
        body.update(object="chat.completion", choices=[
            {"index": 0, "message": {"role": "assistant", "content": text}, "token_ids": [first], "logprobs": None,
             "finish_reason": "length", "stop_reason": None}])
        body["kv_transfer_params"]["prompt_token_ids"] = tokens.tolist()
    return 200, body


async def _read_body(request):
    """The request's raw body, or the 413 to answer in OpenAI's error shape when it is over `MAX_BODY_BYTES`: a
    declared Content-Length over the limit is answered at once (without waiting for a body it may never send)."""
    from aiohttp import web

    size = request.content_length or "more than the limit"
    too_large = web.json_response(error_body(413, f"the request body ({size} bytes) is larger than the limit of "
                                             f"{MAX_BODY_BYTES // 2**20} MiB"), status=413)
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return too_large


class HttpIntake:
    """Process 0's HTTP request source for the launcher's loop: `get` (the `batching.LineReader` contract: a
    `(raw line, arrival)` item, never None: the server runs until the process ends) and `deliver` (every record the
    loop emits; the one for a waiting HTTP request becomes its answer).

    Args:
      host, port: where to listen (port 0: any free port; `port` then holds the bound one after `start`).
      model_name: the name /v1/models and responses give; `model` in a request must match it.
      vocab_size, max_tokens: the boundary's limits. tokenizer_path: the checkpoint's tokenizer.json, or None (its
        directory's chat template, if any, serves /v1/chat/completions).
      top_k: --top_k (the most `logprobs`). kv_store: the launcher's `kv.store.KVStore` (--kv_dir, --overwrite).
      kv_pool_gib: the NIXL pool's size (GiB) each answered request's KV is also published in (0: files only);
        default $SLOPE_JAX_KV_POOL_GIB, else 1. kv_lease_s: how long an unread pool entry lives; default
        $SLOPE_JAX_KV_LEASE_S, else 60. Without NIXL installed the endpoint serves files only (logged).
      host_tier: the engine's host prefix tier (`PrefillEngine.host_tier`, None: off): a request's KV is published
        into the pool from its whole-prompt entry there when it has one (`kv.prefix.export_rows`), else re-read from
        the export just written.
      peer_pools: under several processes, `() -> {process: occupancy}` of the other processes' pools
        (`serve.peer_rows.PeerRows.peer_pools`), shown by GET /v1/kv/pool; None: one process.
    """

    VALIDATION_THREADS = 8

    def __init__(self, host: str, port: int, *, model_name: str, vocab_size: int, max_tokens: int,
                 tokenizer_path: str | None, top_k: int, kv_store, kv_pool_gib: float | None = None,
                 kv_lease_s: float | None = None, host_tier=None, peer_pools=None):
        self.host, self.port, self.model_name = host, port, model_name
        self.kv_pool_gib = float(os.environ.get(POOL_GIB_ENV, 1.0) if kv_pool_gib is None else kv_pool_gib)
        self.kv_lease_s = float(os.environ.get(LEASE_ENV, 60.0) if kv_lease_s is None else kv_lease_s)
        self.kv_pool = None  # the NIXL pool (`start`), None: files only
        self.host_tier = host_tier  # the engine's host prefix tier: what the pool is filled from when it can be
        self.peer_pools = peer_pools  # () -> {process: its pool's occupancy} under several processes, else None
        self._entries: dict[str, str] = {}  # request id → its pool entry (discarded on release)
        self._peer_drops: dict[str, Callable[[], None]] = {}  # request id → drops its peers' entries (`compose`)
        self._exporting: set[str] = set()  # ids answered over NIXL before their export was written (`deliver_early`)
        self._unpublished: dict[str, str] = {}  # request id → why `publish` could not put its KV in the pool
        self._reclaim_when_written: set[str] = set()  # of those, ids released meanwhile
        self._limits = dict(model_name=model_name, vocab_size=vocab_size, max_tokens=max_tokens, top_k=top_k,
                            kv_store=kv_store)
        self._tokenizer_path = tokenizer_path
        self._chat_template = ChatTemplate.find(os.path.dirname(tokenizer_path) if tokenizer_path else None)
        self._queue: queue.Queue = queue.Queue()
        self._waiters: dict[str, tuple[asyncio.Future, Validated]] = {}
        self._abandoned: set[str] = set()  # ids whose client left before the answer (their exports are reclaimed)
        self._served: set[str] = set()  # ids answered with an export (what /v1/kv/release may remove)
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._number = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner = None
        # validation (JSON, chat template, tokenization) runs here, off the event loop: a 12 MB body must not hold
        # other requests (`_Unlocked` releases the GIL while tokenizing)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.VALIDATION_THREADS, "slope_jax-http-validate")

    # ---- the launcher's side (main thread) -------------------------------------------------------------------
    def start(self) -> None:
        """Bind and serve on a daemon thread; returns once listening. Raises OSError if the address is taken."""
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(self._tokenizer_path) if self._tokenizer_path else None
        self._start_pool()
        started = threading.Event()
        failure: list[BaseException] = []
        thread = threading.Thread(target=self._run, args=(tokenizer, started, failure), name="slope_jax-http",
                                  daemon=True)
        thread.start()
        started.wait()
        if failure:
            raise failure[0]
        logging.info("prefill endpoint: http://%s:%d/v1/completions (model %r; chat template: %s)", self.host,
                     self.port, self.model_name, "yes" if self._chat_template else "none")

    def _start_pool(self) -> None:
        if self.kv_pool_gib <= 0:
            return
        try:
            from slope_jax.kv import nixl_transport as nt

            # pages touched now, as registering them for RDMA would pin them: a first touch costs 1.3-2.9 s per GiB
            # on this VM, which a publish would otherwise pay inside a request's answer
            t0 = time.perf_counter()
            self.kv_pool = nt.KVPool(int(self.kv_pool_gib * 2**30), lease_s=self.kv_lease_s, prefault=True)
        except Exception as e:  # noqa: BLE001 - no NIXL (not installed, no UCX): the file exports still serve
            logging.warning("prefill endpoint: no NIXL pool (%s: %s); the decode side reads the file exports",
                            type(e).__name__, e)
            return
        logging.info("prefill endpoint: NIXL pool %s of %.2f GiB, lease %.0f s (allocated and touched in %.1f s)",
                     self.kv_pool.name, self.kv_pool_gib, self.kv_lease_s, time.perf_counter() - t0)

    def wants_early(self, rid: str) -> bool:
        """Whether request `rid` waits here for an answer over NIXL (`deliver_early` would serve it)."""
        with self._lock:
            waiter = self._waiters.get(rid)
        return self.kv_pool is not None and waiter is not None and waiter[1].nixl

    def deliver_early(self, record: dict, export) -> None:
        """The launcher's loop (process 0) has a request's first token and is about to keep and export its KV
        (`PrefillEngine.prefill`'s `on_computed`): a waiting HTTP request that hands its KV over NIXL is answered
        now, from the pool, instead of after the export (1-2 s per GiB on this machine's disk). `record`: its
        result record without the export (`kv_path` where it will be); `export`: its `engine.PendingExport` (the
        manifest the export will carry, the rows it will hold). The copy into the pool runs here, on the loop's
        thread, before the export starts: the export would otherwise compete with it for the cores and delay the
        answer. A request not over NIXL, or one the pool has no room for (logged), is answered from its record."""
        from slope_jax.kv import nixl_transport as nt

        rid = record.get("id")
        if export is None or not export.local or not self.wants_early(rid):
            return
        t0 = time.perf_counter()
        try:
            params, drop, t1 = self._publish_early(rid, export)
        except Exception as e:  # noqa: BLE001 - never fails the step: the request's record answers it as before
            log = logging.info if isinstance(e, nt.KVPoolFull) else logging.warning
            log("request %s: not published before its export (%s: %s); answered after it", rid, type(e).__name__, e)
            return
        handoff = {**params, "publish_ms": round((time.perf_counter() - t0) * 1e3, 3), "publish_from": "memory"}
        rec = params[nt.PARAMS_KEY]
        own = nt.parts_of(rec)[0]["entry"]
        with self._lock:
            waiter = self._waiters.pop(rid, None)
            if waiter is not None:
                self._entries[rid] = own
                self._peer_drops[rid] = drop
                self._exporting.add(rid)
        if waiter is None:  # its client left meanwhile: nobody reads these entries
            self.kv_pool.discard(own)
            drop()
            return
        parts = len(nt.parts_of(rec))
        logging.info("request %s: answered over NIXL before its export is written (%s ms to publish: %.1f ms "
                     "gathering its rows%s, %.1f ms copying them into the pool)", rid, handoff["publish_ms"],
                     (t1 - t0) * 1e3, f" (the record names {parts} processes' pools)" if parts > 1 else "",
                     handoff["publish_ms"] - (t1 - t0) * 1e3)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(_resolve, waiter[0], {**record, "_handoff": handoff})

    def _publish_early(self, rid: str, export) -> tuple[dict, Callable[[], None], float]:
        """(kv_transfer_params, a function dropping the peers' entries, when the rows were at hand). Several
        processes whose peers offered their pieces: this process's pieces go into its pool and the record names
        every process's pool (`nixl_transport.compose`: the decode side pulls each piece from where it was
        computed); else the whole rows go into this pool. Raises KVPoolFull, or what gathering the rows raises."""
        from slope_jax.kv import nixl_transport as nt

        manifest = nt.handoff_manifest(export.manifest)
        if not export.offered:
            rows = export.rows()
            return self.kv_pool.publish(rid, rows, manifest), lambda: None, time.perf_counter()
        offered = export.offer()
        t1, own = time.perf_counter(), None
        try:
            own = self.kv_pool.publish_pieces(rid, offered.pieces, offered.kinds)[nt.PARAMS_KEY]
            return nt.compose(rid, [own] + offered.records, manifest), offered.drop, t1
        except BaseException:
            offered.drop()
            if own is not None:
                self.kv_pool.discard(own["entry"])
            raise

    def publish(self, rid: str, kv_path: str) -> dict | None:
        """Publish the export of `rid` in the NIXL pool: its hand-off kv_transfer_params (`KVPool.publish`'s, plus
        `publish_ms` and `publish_from`: "host tier" — the rows copied from the engine's memory — or "export", re-read
        from the files), or None — no pool, or it does not fit beside the entries readers hold (then the file alone
        serves; logged)."""
        from slope_jax.kv import nixl_transport as nt
        from slope_jax.kv import prefix as prefix_lib

        if self.kv_pool is None:
            return None
        t0 = time.perf_counter()
        try:
            target = kvfmt.resolve(kv_path)  # one version: the manifest and the rows of the same export
            manifest = kvfmt.read_manifest(target)
            kv = prefix_lib.export_rows(self.host_tier, manifest) if self.host_tier is not None else None
            if kv is not None:
                params, source = self.kv_pool.publish(rid, kv, nt.handoff_manifest(manifest)), "host tier"
            else:  # written by this run just now: its SHA-256 was computed as it was written
                params, source = self.kv_pool.publish_export(target, verify=False), "export"
        except (nt.KVPoolFull, kvfmt.KVFormatError, OSError, ValueError) as e:
            logging.warning("request %s: KV not published over NIXL (%s: %s); the file export serves", rid,
                            type(e).__name__, e)
            with self._lock:
                self._unpublished[rid] = f"{type(e).__name__}: {e}"
            return None
        with self._lock:
            self._entries[rid] = params[nt.PARAMS_KEY]["entry"]
        return {**params, "publish_ms": round((time.perf_counter() - t0) * 1e3, 3), "publish_from": source}

    def get(self, timeout_s: float | None):
        """The next request line `(raw bytes, arrival)`; raises queue.Empty after `timeout_s` (None: block). A
        request whose client left while it waited here comes as `(requests.ClientLeft(id), arrival)`: the loop
        records it as cancelled and never computes it."""
        if timeout_s is None or timeout_s > 0:
            rid, line, arrival = self._queue.get(timeout=timeout_s)
        else:
            rid, line, arrival = self._queue.get_nowait()
        with self._lock:
            return (requests.ClientLeft(rid) if rid in self._abandoned else line), arrival

    def clients_left(self) -> set[str]:
        """Ids of the requests whose client disconnected before their answer (the loop cancels those it still
        queues: `front.Intake`; their records' `deliver` forgets them)."""
        with self._lock:
            return set(self._abandoned)

    def deliver(self, record: dict) -> None:
        """Route one emitted record to the HTTP request waiting for its id (others are ignored; the export of one
        whose client left is reclaimed)."""
        rid = record.get("id") if isinstance(record.get("id"), str) else None
        with self._lock:
            waiter = self._waiters.pop(rid, None)
            abandoned = waiter is None and rid in self._abandoned
            self._abandoned.discard(rid)
            answered_early = rid in self._exporting
            self._exporting.discard(rid)
            released = rid in self._reclaim_when_written
            self._reclaim_when_written.discard(rid)
        if answered_early and not record.get("kv_path"):
            logging.warning("request %s was answered over NIXL, but its export then failed: %s", rid,
                            record.get("error") or record.get("export_error"))
        if waiter is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(_resolve, waiter[0], record)
        elif (abandoned or released) and record.get("kv_path"):
            self._pool.submit(self.reclaim, rid)

    def reclaim(self, rid: str) -> tuple[bool, str]:
        """Remove the export of `rid` now that nobody will read it (the decode side consumed it, or its client left):
        (removed, why). An export holding prefix-reuse blocks (`prefix.hashes`) is kept as the prefill's cache for
        later prompts sharing its prefix; kv_dir retention (--kv_dir_max_gib, --kv_dir_max_age_h) bounds those."""
        with self._lock:
            entry = self._entries.pop(rid, None)
            drop = self._peer_drops.pop(rid, None)
            exporting = rid in self._exporting
            if exporting:  # answered over NIXL before its export: `deliver` reclaims it once its record comes
                self._reclaim_when_written.add(rid)
        if entry is not None and not self.kv_pool.discard(entry):
            logging.info("request %s: pool entry %s is held by a reader (or gone): the reader's release or the lease "
                         "frees it", rid, entry)
        if drop is not None:  # the other processes' entries: freed once no reader holds them
            drop()
        if exporting:
            return False, "its export is still being written: reclaimed once written"
        path = os.path.join(self._limits["kv_store"].kv_dir, rid)
        try:
            m = kvfmt.read_manifest(path)
        except (kvfmt.KVFormatError, OSError):
            return False, "no such export (removed already?)"
        if (m.get("prefix") or {}).get("hashes"):
            return False, "kept for prefix reuse (it holds reusable blocks; kv_dir retention bounds such exports)"
        try:
            # only what the export format writes is removed: a pointer naming a version directory inside kv_dir (or a
            # plain export directory); a link elsewhere is refused by `pointer_version`, never followed
            target = os.path.join(os.path.dirname(path), kvfmt.pointer_version(os.path.dirname(path), rid)
                                  if os.path.islink(path) else rid)
            if os.path.islink(path):
                os.remove(path)  # the pointer first: a reader resolving it now finds no export, never a partial one
        except FileNotFoundError:
            return False, "no such export (removed already?)"
        except (kvfmt.KVFormatError, OSError) as e:
            return False, f"not removed: {e}"
        kvfmt.remove_tree(target)
        logging.info("request %s: export %s reclaimed", rid, path)
        return True, "removed"

    # ---- the server (its own thread and event loop) ----------------------------------------------------------
    def _run(self, tokenizer, started: threading.Event, failure: list) -> None:
        from aiohttp import web

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app["tokenizer"] = tokenizer
        app.router.add_post("/v1/completions", functools.partial(self._completions, chat=False))
        app.router.add_post("/v1/chat/completions", functools.partial(self._completions, chat=True))
        app.router.add_post("/v1/kv/release", self._release)
        app.router.add_get("/v1/kv/pool", self._pool_stats)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        # a client that disconnects cancels its handler (aiohttp's default lets it run on): `_completions` then drops
        # the request if it is still queued, or reclaims its export when it is done
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, self.port)
            loop.run_until_complete(site.start())
            self.port = runner.addresses[0][1]
        except BaseException as e:  # noqa: BLE001 - reported to start() in the main thread
            failure.append(e)
            started.set()
            return
        self._loop, self._runner = loop, runner
        started.set()
        loop.run_forever()

    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok", "model": self.model_name})

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "slope_jax",
             "max_model_len": self._limits["max_tokens"]}]})

    async def _completions(self, request, chat: bool):
        from aiohttp import web

        arrival = time.perf_counter()
        body = await _read_body(request)
        if not isinstance(body, bytes):
            return body
        self._number += 1  # only the event loop thread counts
        check = functools.partial(validate, body, dict(request.headers), self._number,
                                  tokenizer=request.app["tokenizer"], seen_ids=self._seen, arrival=arrival, chat=chat,
                                  chat_template=self._chat_template, **self._limits)
        checked = asyncio.get_running_loop().run_in_executor(self._pool, check)
        try:
            v = await asyncio.shield(checked)
        except HttpError as e:
            return web.json_response(error_body(e.status, str(e), e.param), status=e.status)
        except asyncio.CancelledError:  # the client left while its body was checked: the id is taken, so it gets
            checked.add_done_callback(functools.partial(self._left_in_validation, arrival))  # a cancelled record
            raise
        if v.ignored:
            logging.debug("request %s: fields not read by the prefill: %s", v.id, ", ".join(v.ignored))
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiters[v.id] = (future, v)
        self._queue.put((v.id, v.line.encode(), arrival))
        try:
            record = await asyncio.shield(future)
        except asyncio.CancelledError:  # the client left: drop the request if still queued, else reclaim its export
            self._abandon(v.id, future)
            raise
        handoff = record.get("_handoff")  # published before the export (`deliver_early`)
        status, out = completion_body(record, v, self.model_name)
        if status == 200:
            self._served.add(v.id)
            if handoff is None and v.nixl and self.kv_pool is not None:  # copied into the pool off the event loop
                handoff = await asyncio.get_running_loop().run_in_executor(self._pool, self.publish, v.id,
                                                                           record["kv_path"])
            if handoff is not None:
                out["publish_ms"] = handoff.pop("publish_ms")
                out["publish_from"] = handoff.pop("publish_from")
                out["kv_transfer_params"].update(handoff)
            elif v.nixl:  # why the proxy's NIXL request goes by files (its warning names it)
                with self._lock:
                    why = self._unpublished.pop(v.id, None)
                out["kv_transfer_params"][NIXL_UNAVAILABLE] = why or (
                    "this prefill endpoint has no NIXL pool (its start-up log says why)" if self.kv_pool is None
                    else "not published")
            if record.get("export_pending"):
                out["export_pending"] = True
        return web.json_response(out, status=status)

    def _left_in_validation(self, arrival: float, checked: asyncio.Future) -> None:
        """The client of a request left while `validate` ran: a valid request has reserved its id, so it is queued
        as abandoned (`get` hands it over as `ClientLeft`: one `"cancelled": true` record, nothing computed), as when
        the client leaves later; an invalid one (no id taken) is only logged."""
        if checked.cancelled() or checked.exception() is not None:
            logging.info("a client disconnected while its invalid request was checked")
            return
        v = checked.result()
        with self._lock:
            self._abandoned.add(v.id)
        self._queue.put((v.id, v.line.encode(), arrival))
        logging.info("request %s: the client disconnected before its answer", v.id)

    def _abandon(self, rid: str, future: asyncio.Future) -> None:
        with self._lock:
            waiting = self._waiters.pop(rid, None) is not None
            if waiting:
                self._abandoned.add(rid)  # `get` drops it, or `deliver` reclaims its export
        if not waiting:  # its record came just before the client left (it may still be on its way to `future`)
            future.add_done_callback(lambda f: "kv_path" in f.result() and self._pool.submit(self.reclaim, rid))
        logging.info("request %s: the client disconnected before its answer", rid)

    async def _pool_stats(self, request):
        """GET /v1/kv/pool: the NIXL pool's occupancy (`KVPool.stats` less per-entry detail; {"pool": null} without
        one)."""
        from aiohttp import web

        if self.kv_pool is None:
            return web.json_response({"pool": None})
        stats = self.kv_pool.stats()
        stats.pop("per_entry")
        peers = {}
        if self.peer_pools is not None:  # a coordination-service call: off the event loop
            got = await asyncio.get_running_loop().run_in_executor(None, self.peer_pools)
            peers = {"peers": {str(k): v for k, v in got.items()}}
        return web.json_response({"pool": self.kv_pool.name, "lease_s": self.kv_lease_s, **stats, **peers})

    async def _release(self, request):
        """POST /v1/kv/release {"request_id": id}: the decode side is done with the export of `id` (`reclaim`)."""
        from aiohttp import web

        try:
            rid = requests.loads_strict((await request.read()).decode("utf-8")).get("request_id")
        except (ValueError, UnicodeDecodeError, AttributeError, RecursionError):
            rid = None
        if not isinstance(rid, str):
            return web.json_response(error_body(400, "the body must be {\"request_id\": the id of an export this "
                                                "server answered}", "request_id"), status=400)
        if rid not in self._served:
            return web.json_response(error_body(404, f"no export of request {requests._short(rid)} awaits release "
                                                "here (this server did not answer it, or it was released already)",
                                                "request_id"), status=404)
        self._served.discard(rid)
        removed, why = await asyncio.get_running_loop().run_in_executor(self._pool, self.reclaim, rid)
        return web.json_response({"request_id": rid, "removed": removed, "reason": why})


def _resolve(future: asyncio.Future, record: dict) -> None:
    if not future.done():
        future.set_result(record)
