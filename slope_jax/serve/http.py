r"""The prefill endpoint of a prefill/decode (P/D) deployment: an OpenAI-style completions route on the coordinator
(process 0), feeding the launcher's SLO scheduler like the stdin/file reader does (`slope-jax --http_port=PORT`).

    POST /v1/completions   {"prompt": "It was the best" | [ids...], "max_tokens": 1, "ttft_slo_ms": 500,
                            "logprobs": 2, "request_id": "doc-17", "model": NAME}
      200: an OpenAI completion whose one choice is the first token (text, token_ids, logprobs if asked), plus
           ttft_ms / queue_ms / compute_ms / compile_ms / export_ms / predicted_ttft_ms (the scheduler's cost model)
           and `kv_transfer_params` for the decode side's connector (`slope_jax.kv.vllm_connector`):
           {"slope_jax_kv_path": absolute export directory, "slope_jax_first_token": int, "num_tokens": int,
            "token_ids_sha256": `slope_jax.kv.format.token_hash(ids)`}. The path is process 0's: the decode
           server must see the same filesystem (one machine, or --kv_dir on a shared one).
      400: the request breaks a rule; `error.param` names the field and `error.message` the rule (the launcher's
           request boundary, `slope_jax.serve.requests`, unchanged: same checks, same messages).
      404: `model` is not the served model.  409: the request id's export exists (the launcher's --overwrite).
      503: rejected by SLO admission (`--slo_policy=reject`): the message gives predicted vs allowed TTFT.
      500: the boundary accepted it but the engine could not serve it (its bucket does not fit device memory, or
           the prefill failed); the message says which.
    GET /health  200 once the engine is loaded (the server starts after that).    GET /v1/models  the served model.

Body fields. `prompt`: a non-empty string (tokenized with the checkpoint's tokenizer.json by the boundary's rule:
special-token strings such as "<|endoftext|>" become the control token, nothing is prepended), a non-empty list of
token ids, or a list holding exactly one of those. `max_tokens` / `max_completion_tokens`: absent or 1 — this
server produces the first token only; the decode server makes the rest (`slope_jax.serve.pd_proxy` sends the same
request there). `logprobs`: null or 0..--top_k top log-probabilities of the first position (OpenAI's legacy
shape; `top_logprobs` keys are token ids as strings: distinct tokens can decode to the same text). `ttft_slo_ms`: finite
number > 0 (default --ttft_slo_ms). `request_id` (or header X-Request-Id): names the KV export directory, the
boundary's id rule, unique within the run; default "cmpl-<32 hex>". `model`: absent or the served name
(--http_model_name). `stream`, `echo`: absent or false; `n`, `best_of`: absent or 1. `kv_transfer_params`: the P/D
proxy's {"do_remote_decode": true, ...}; read for nothing (the export is always written). Sampling fields that only
shape decoding (`temperature`, `top_p`, `seed`, `stop`, ... see `_DECODE_ONLY`) are accepted and ignored: the
prefill's own first token is always greedy (argmax), and the decode engine recomputes the last prompt position and
samples its first token itself. Any other field is a 400 naming it.

Library: aiohttp, server and client in one well-kept package (the proxy uses both). vLLM itself serves with FastAPI
on uvicorn, and its P/D example proxies use httpx or aiohttp; the wire format is what matters, and it is OpenAI's.

Threads: aiohttp serves on its own event loop thread; the handler validates the body (no engine needed), queues one
request line `{"id", "tokens", "ttft_slo_ms"}` with its arrival time for the launcher's loop (`get`, the
`batching.LineReader` contract), and waits for the record the loop emits for that id (`deliver`), which becomes the
HTTP answer. The loop itself (admission, batching, compute on every process, export, result records) is unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
import time
import uuid
from typing import Any

from absl import logging

from slope_jax.kv import format as kvfmt
from slope_jax.serve import requests

# OpenAI / vLLM completion fields that shape decoding only: accepted (a P/D proxy forwards the client's whole body)
# and ignored here.
_DECODE_ONLY = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "user", "suffix", "min_tokens", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "stream_options",
    "return_token_ids", "priority"})
_FIELDS = frozenset({"prompt", "model", "max_tokens", "max_completion_tokens", "logprobs", "ttft_slo_ms",
                     "request_id", "stream", "echo", "n", "best_of", "kv_transfer_params", "cache_salt"}) | _DECODE_ONLY


class HttpError(Exception):
    """An HTTP error answer: `status`, the message, and `param` (the body field at fault, or None)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error", 500: "server_error",
                503: "slo_rejected"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape (as vLLM answers): {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": param,
                      "code": status}}


class Validated:
    """A completion request that passed every check here: `line` is the request line for the launcher's loop."""

    def __init__(self, request: requests.Request, logprobs: int | None):
        self.request, self.logprobs = request, logprobs
        self.id = request.id
        self.line = json.dumps({"id": request.id, "tokens": request.tokens.tolist(),
                                **({} if request.ttft_slo_ms is None else {"ttft_slo_ms": request.ttft_slo_ms})})


def _param_of(message: str) -> str:
    """The HTTP field a boundary message is about. The id's format is checked before the boundary runs, so the
    boundary can only fault the prompt, `ttft_slo_ms` or `cache_salt` (named in quotes) or a duplicate id."""
    for field in ("ttft_slo_ms", "cache_salt"):
        if f"'{field}'" in message:
            return field
    if "duplicate id" in message:
        return "request_id"
    return "prompt"


def validate(body: bytes, headers: dict, number: int, *, model_name: str, vocab_size: int, max_tokens: int,
             tokenizer, seen_ids: set[str], top_k: int, kv_store, arrival: float | None = None) -> Validated:
    """Check one POST /v1/completions body. Raises HttpError naming the field and the rule.

    Args:
      body: the raw body (UTF-8 JSON object). headers: request headers (for X-Request-Id).
      number: 1-based count of completion requests received (messages say "request N (id): ...").
      model_name: the served model name. vocab_size, max_tokens, tokenizer: the boundary's limits and tokenizer
        (`tokenizers.Tokenizer` or None; not shared with another thread: the boundary toggles a flag on it).
      seen_ids: ids used so far in this run (updated; the boundary's uniqueness rule).
      top_k: the most `logprobs` a request may ask for (--top_k). kv_store: the owner of the export directory's
        policy (`slope_jax.kv.store.KVStore`): its `check_new` refuses an id whose export exists (409).
      arrival: perf_counter() seconds of the request's arrival (default now).
    """
    obj = _decode_body(body, number)
    where = f"request {number}"
    _check_fields(obj, where, model_name)
    _check_first_token_only(obj, where)
    logprobs = _check_answer_options(obj, where, top_k)
    rid, param_id = _request_id(obj, headers, where)
    line = {"id": rid, **{k: obj[k] for k in ("ttft_slo_ms", "cache_salt") if obj.get(k) is not None}}
    line.update(_prompt_field(obj, where, tokenizer))
    try:
        req = requests.parse(json.dumps(line), number, vocab_size=vocab_size, max_tokens=max_tokens,
                             tokenizer=tokenizer, seen_ids=seen_ids, arrival=arrival, label="request")
    except requests.LineError as e:
        message = str(e).replace("'tokens'", "'prompt'").replace("'text'", "'prompt'")
        raise HttpError(400, message, param_id if _param_of(message) == "request_id" else _param_of(message)) from e
    try:
        kv_store.check_new(req.id)
    except kvfmt.ExportExistsError as e:
        raise HttpError(409, f"{where} ({req.id}): {e}", param_id) from e
    return Validated(req, logprobs)


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


def _check_fields(obj: dict, where: str, model_name: str) -> None:
    """Known fields only (400), and `model`, when given, is the served one (404)."""
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise HttpError(400, f"{where}: unknown field(s) {requests._short(unknown, 120)}; the prefill endpoint "
                        f"accepts {sorted(_FIELDS - _DECODE_ONLY)} and ignores decode-only sampling fields",
                        unknown[0])
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise HttpError(400, f"{where}: 'model' must be a string, got {type(model).__name__}", "model")
    if model is not None and model != model_name:
        raise HttpError(404, f"{where}: model {requests._short(model)} is not served here; this server serves "
                        f"{model_name!r}", "model")


def _check_first_token_only(obj: dict, where: str) -> None:
    """The fields that would ask for more than one greedy first token in one body: max_tokens /
    max_completion_tokens 1, stream / echo false, n / best_of 1 (each may be absent)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = obj.get(name)
        if value is not None and (isinstance(value, bool) or value != 1):
            raise HttpError(400, f"{where}: '{name}' must be 1 (or absent), got {requests._short(value)}: the "
                            "prefill endpoint produces the first token only; send the request to the decode server "
                            "for the rest (slope_jax.serve.pd_proxy does both)", name)
    for name in ("stream", "echo"):
        if obj.get(name) is not None and obj[name] is not False:
            raise HttpError(400, f"{where}: '{name}' must be false (or absent), got {requests._short(obj[name])}: "
                            "the prefill endpoint answers with one JSON body holding the first token", name)
    for name in ("n", "best_of"):
        if obj.get(name) not in (None, 1) or isinstance(obj.get(name), bool):
            raise HttpError(400, f"{where}: '{name}' must be 1 (or absent), got {requests._short(obj[name])}: one "
                            "greedy first token per request", name)


def _check_answer_options(obj: dict, where: str, top_k: int) -> int | None:
    """`logprobs` (an integer in [0, top_k] or null; returned) and `kv_transfer_params` (an object or null)."""
    logprobs = obj.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= top_k):
        raise HttpError(400, f"{where}: 'logprobs' must be an integer in [0, {top_k}] (--top_k) or null, got "
                        f"{requests._short(logprobs)}", "logprobs")
    ktp = obj.get("kv_transfer_params")
    if ktp is not None and not isinstance(ktp, dict):
        raise HttpError(400, f"{where}: 'kv_transfer_params' must be an object or null, got "
                        f"{type(ktp).__name__}", "kv_transfer_params")
    return logprobs


def _request_id(obj: dict, headers: dict, where: str) -> tuple[str, str]:
    """(id, the field it came from): `request_id`, else the X-Request-Id header, else a fresh "cmpl-<uuid>";
    HttpError 400 when its format breaks the id rule (`requests.check_request_id`)."""
    rid = obj.get("request_id", headers.get("X-Request-Id"))
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
        if len(prompt) != 1:
            raise HttpError(400, f"{where}: 'prompt' holds {len(prompt)} prompts; the prefill endpoint takes one per "
                            "request", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None and prompt:
            raise HttpError(400, f"{where}: 'prompt' is text, and the checkpoint has no tokenizer.json; send token "
                            "ids instead", "prompt")
        return {"text": prompt}
    if not isinstance(prompt, list):
        raise HttpError(400, f"{where}: 'prompt' must be a string or a list of token ids, got "
                        f"{type(prompt).__name__}", "prompt")
    return {"tokens": prompt}


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
    for key in ("ttft_ms", "queue_ms", "compute_ms", "compile_ms", "export_ms", "predicted_ttft_ms", "ttft_slo_ms",
                "slo_met", "late"):
        if key in record:
            body[key] = record[key]
    return 200, body


class HttpIntake:
    """Process 0's HTTP request source for the launcher's loop: `get` (the `batching.LineReader` contract: a
    `(raw line, arrival)` item, never None: the server runs until the process ends) and `deliver` (every record the
    loop emits; the one for a waiting HTTP request becomes its answer).

    Args:
      host, port: where to listen (port 0: any free port; `port` then holds the bound one after `start`).
      model_name: the name /v1/models and responses give; `model` in a request must match it.
      vocab_size, max_tokens: the boundary's limits. tokenizer_path: the checkpoint's tokenizer.json, or None.
      top_k: --top_k (the most `logprobs`). kv_store: the launcher's `kv.store.KVStore` (--kv_dir, --overwrite).
    """

    def __init__(self, host: str, port: int, *, model_name: str, vocab_size: int, max_tokens: int,
                 tokenizer_path: str | None, top_k: int, kv_store):
        self.host, self.port, self.model_name = host, port, model_name
        self._limits = dict(model_name=model_name, vocab_size=vocab_size, max_tokens=max_tokens, top_k=top_k,
                            kv_store=kv_store)
        self._tokenizer_path = tokenizer_path
        self._queue: queue.Queue = queue.Queue()
        self._waiters: dict[str, tuple[asyncio.Future, Validated]] = {}
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._number = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner = None

    # ---- the launcher's side (main thread) -------------------------------------------------------------------
    def start(self) -> None:
        """Bind and serve on a daemon thread; returns once listening. Raises OSError if the address is taken."""
        from tokenizers import Tokenizer

        # the handler thread's own tokenizer: the boundary toggles `encode_special_tokens` on it
        tokenizer = Tokenizer.from_file(self._tokenizer_path) if self._tokenizer_path else None
        started = threading.Event()
        failure: list[BaseException] = []
        thread = threading.Thread(target=self._run, args=(tokenizer, started, failure), name="slope_jax-http",
                                  daemon=True)
        thread.start()
        started.wait()
        if failure:
            raise failure[0]
        logging.info("prefill endpoint: http://%s:%d/v1/completions (model %r)", self.host, self.port,
                     self.model_name)

    def get(self, timeout_s: float | None):
        """The next request line `(raw bytes, arrival)`; raises queue.Empty after `timeout_s` (None: block)."""
        return self._queue.get(timeout=timeout_s) if timeout_s is None or timeout_s > 0 else self._queue.get_nowait()

    def deliver(self, record: dict) -> None:
        """Route one emitted record to the HTTP request waiting for its id (others are ignored)."""
        with self._lock:
            waiter = self._waiters.pop(record.get("id"), None) if isinstance(record.get("id"), str) else None
        if waiter is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(_resolve, waiter[0], record)

    # ---- the server (its own thread and event loop) ----------------------------------------------------------
    def _run(self, tokenizer, started: threading.Event, failure: list) -> None:
        from aiohttp import web

        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        app = web.Application(client_max_size=64 * 2**20)  # a 128K-token prompt is ~1 MB as JSON ids
        app["tokenizer"] = tokenizer
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
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

    async def _completions(self, request):
        from aiohttp import web

        arrival = time.perf_counter()
        body = await request.read()
        self._number += 1  # only the event loop thread touches the count, the seen ids and the tokenizer
        try:
            v = validate(body, request.headers, self._number, tokenizer=request.app["tokenizer"],
                         seen_ids=self._seen, arrival=arrival, **self._limits)
        except HttpError as e:
            return web.json_response(error_body(e.status, str(e), e.param), status=e.status)
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._waiters[v.id] = (future, v)
        self._queue.put((v.line.encode(), arrival))
        record = await future  # a client that disconnects does not stop its prefill: its record still comes
        status, out = completion_body(record, v, self.model_name)
        return web.json_response(out, status=status)


def _resolve(future: asyncio.Future, record: dict) -> None:
    if not future.done():
        future.set_result(record)
