r"""`python -m slope_jax.serve.pd_proxy`: the P/D proxy. One client request → the slope_jax prefill endpoint
(`slope-jax --http_port`, `slope_jax.serve.http`) → a `vllm serve` decode server that loads the export with
`SlopeJaxConnector` → the decode server's answer back to the client, streamed (`"stream": true`, server-sent events)
or as one JSON body, exactly as the decode server sent it.

  python -m slope_jax.serve.pd_proxy --port=8000 --prefill_url=http://127.0.0.1:8100 --decode_url=http://127.0.0.1:8200
  curl -s 127.0.0.1:8000/v1/completions -d '{"prompt": "It was the best of times", "max_tokens": 16}'

Routes: POST /v1/completions and /v1/chat/completions; GET /health (200 when both servers answer theirs);
GET /v1/models (the decode server's); any other method and path (/metrics, /version, /ping, /tokenize, /detokenize,
/v1/responses, ...) is relayed to the decode server unchanged (method, path, query string, body, headers less the
hop-by-hop ones) and its answer back as it comes (status, content type, headers, body).

Limits: a body of up to --max_body_mib (default 1024 MiB; a larger one: 413 in OpenAI's error shape naming the limit
and the flag), parsed and re-encoded on a thread so that it never holds up other requests; no limit on connections to
the two servers (aiohttp's default pool of 100 made request 101 wait while 100 streams were open). A list of more
prompts than $VLLM_MAX_COMPLETION_PROMPTS (vLLM's variable and default, 1024) is refused as vLLM refuses it (400
naming `prompt`, its message) before any prefill.

Transparent: whatever `vllm serve` accepts the proxy passes on. The flow is vLLM's own disaggregated-serving proxy's
(vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py):
- The prefill server gets only what it reads — the prompt (`prompt`, or `messages` and the chat-template options),
  `model`, `ttft_slo_ms`, `cache_salt`, `truncate_prompt_tokens` and `truncation_side` (it truncates the prompt as
  vLLM does, so its export holds exactly the tokens vLLM keeps) — with max_tokens=1, stream=false,
  kv_transfer_params {"do_remote_decode": true} and the export's name as `request_id`; sampling options, structured
  outputs (`structured_outputs`, `response_format`, ...), `n`/`best_of`, `echo`, `logprobs`/`prompt_logprobs` and
  anything else never reach it.
- The decode server gets the client's body unchanged (less the prefill-only `ttft_slo_ms`) with the prefill's
  `kv_transfer_params` (the NIXL hand-off record `slope_jax_nixl`, which the connector pulls from the prefill's pool
  with no shared filesystem, `--kv_transport=nixl`, the default; the export's path, its fallback and, with
  `--kv_transport=files`, the only way: then the prefill publishes nothing and the record is never forwarded;
  first token, token count and token hash; for chat also the prompt's
  token ids, which vLLM's chat route uses instead of rendering its own template, so both engines run the same
  tokens). A prefill error (4xx naming the field, 503 SLO rejection, ...) is relayed unchanged, and nothing is sent
  to the decode server; so is a decode error.
- A `model` the prefill server does not serve (its 404 naming `model`: a LoRA adapter of `vllm serve
  --lora-modules`, another `--served-model-name`) sends the request, a list of prompts too, to the decode server
  whole: vLLM prefills it itself and answers as it would without the proxy (its own error for a model it does not
  serve either); the answer has no X-Slope-Jax-* headers. So does a chat request carrying its own `chat_template`:
  the prefill renders the checkpoint's template only, and vLLM would run the prefill's tokens.
- A list of prompts (`"prompt": ["a", "b"]`, or token-id lists; a list mixing the two goes to the prefill whole,
  which refuses it naming `prompt`, as vLLM does) is fanned out: one prefill per prompt, each with its own export,
  then one decode request per prompt (vLLM applies one request's kv_transfer_params to every prompt of a list, so a
  list cannot carry one export per prompt). At most --list_concurrency (default 4) of a list's prefills are in
  flight at once, then as many of its decode requests: the prefill server serves its queue in arrival order, and a
  list sent whole would queue every other client's request behind all of its prompts. The answers are merged as
  vLLM answers a list: choice `index` = prompt index × n + the choice's own index, usage summed field by field
  (nested details too), the first answer's id, and kv_transfer_params reporting every prompt's load
  (`load_status`: loaded tokens summed, each prompt's status in `slope_jax_prompts`); streamed, the events of the
  prompts are interleaved as they arrive with the same indices, one summed usage chunk (if asked) and one `[DONE]`
  (a decode error after the first event comes as an error event, `data: {"error": ...}`).
- Load status: a JSON answer's kv_transfer_params carries the connector's `slope_jax_status` and
  `slope_jax_loaded_tokens`; where vLLM drops them (a stop string ended the request) the status says so
  ("unreported: ..." with vLLM's cached-token count). Streamed answers carry no status (vLLM sends none).
- Request ids: the client's X-Request-Id header (else its body's `request_id`, else 32 hex digits, to which vLLM
  adds its "cmpl-" in the answer's `id`, as without the proxy) goes to the decode server unchanged (prompt i of a
  list: "<id>-<i>", as vLLM names them) and back in the answer's X-Request-Id. The export is named per attempt,
  "<id, reduced to [A-Za-z0-9._-], at most 100 characters>-<12 hex>", so a retry with the same id is a new export,
  never the first one's KV; the answer's X-Slope-Jax-Export names it (comma-separated for a list), beside
  X-Slope-Jax-First-Token and X-Slope-Jax-TTFT-ms (the prefill's); each header stays under 4,000 characters: a long
  list's names the first ones and ends in ",...(N in all)".
- A client that disconnects cancels its work on both sides: the proxy's handler is cancelled, which closes its
  connections to the prefill (a request whose prefill has not started is cancelled there) and to the decode
  server (vLLM aborts the request).
- Reclaiming: once the decode server's answer has been relayed whole, the proxy tells the prefill server
  (POST /v1/kv/release) that the export was consumed; after a failure or a disconnect it does so `release_grace_s`
  later, when no load of it can still be running. The prefill server removes it unless it is its prefix cache, and
  frees its pool entry unless a reader holds it (the connector itself tells the pool once its request finished).
  A vLLM request that found the same export by token hash and validated it just before is unharmed: the connector
  holds a validated export's files open (`slope_jax.kv.vllm_handoff.Pin`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("prefill_url", "http://127.0.0.1:8100", "Base URL of the slope_jax prefill endpoint.")
flags.DEFINE_string("decode_url", "http://127.0.0.1:8200", "Base URL of the `vllm serve` decode server (started "
                    "with --kv-transfer-config naming SlopeJaxConnector).")
flags.DEFINE_float("timeout_s", 3600.0, "Longest a request may take end to end (prefill queue included).")
flags.DEFINE_enum("kv_transport", "nixl", ["nixl", "files"], "How vLLM gets the KV: 'nixl' (the prefill's pool "
                  "entry pulled over NIXL/UCX, no shared filesystem; the file export stays the fallback) or 'files' "
                  "(the export files only: the prefill publishes nothing in its pool, vLLM reads the files, which it "
                  "must see).")
flags.DEFINE_float("release_grace_s", 30.0, "After a failed or abandoned decode, wait this long before telling the "
                   "prefill server its export may be reclaimed.")
flags.DEFINE_integer("max_body_mib", 1024, "Largest request body the proxy accepts, in MiB (a larger one: 413).")
flags.DEFINE_integer("list_concurrency", 4, "Most prefills (then decode requests) of one list of prompts in flight "
                     "at once, so that other clients' requests interleave with a long list's.")

# what the prefill server reads (`slope_jax.serve.http`); nothing else of the client's body is sent there
_FOR_PREFILL = ("prompt", "model", "ttft_slo_ms", "cache_salt", "truncate_prompt_tokens", "truncation_side")
_FOR_PREFILL_CHAT = ("messages", "model", "ttft_slo_ms", "cache_salt", "add_generation_prompt",
                     "continue_final_message", "chat_template_kwargs", "tools", "documents", "truncate_prompt_tokens",
                     "truncation_side", "reasoning_effort")
_ROUTES = {False: "/v1/completions", True: "/v1/chat/completions"}
_NIXL_KEY = "slope_jax_nixl"  # slope_jax.kv.nixl_transport.PARAMS_KEY (not imported: the proxy needs no NIXL)
STATUS_KEY, LOADED_KEY = "slope_jax_status", "slope_jax_loaded_tokens"  # the connector's (kv.vllm_plan), not imported
MAX_PROMPTS_ENV, MAX_PROMPTS_DEFAULT = "VLLM_MAX_COMPLETION_PROMPTS", 1024  # vLLM's limit on a list of prompts
# headers that describe one hop, not the message (RFC 9110 §7.6.1), or that aiohttp recomputes for the relayed body
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                          "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"})


def prefill_body(body: dict, export_id: str, chat: bool = False, kv_transport: str = "nixl") -> dict:
    """The body sent to the prefill server: the fields it reads (`_FOR_PREFILL`, `_FOR_PREFILL_CHAT`), for one
    token, not streamed, asking for a remote decode, its export named `export_id` (`kv_transport` "files": not
    published in the prefill's NIXL pool)."""
    out = {k: body[k] for k in (_FOR_PREFILL_CHAT if chat else _FOR_PREFILL) if k in body}
    out.update(max_tokens=1, stream=False, request_id=export_id,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                   **({"slope_jax_transport": "files"} if kv_transport == "files" else {})})
    return out


def decode_body(body: dict, kv_transfer_params: dict, kv_transport: str = "nixl") -> dict:
    """The body sent to the decode server: the client's (less the prefill-only `ttft_slo_ms`), with the prefill's
    kv_transfer_params (less the NIXL record with `kv_transport` "files")."""
    if kv_transport == "files":
        kv_transfer_params = {k: v for k, v in kv_transfer_params.items() if k != _NIXL_KEY}
    return {**_for_decode(body), "kv_transfer_params": kv_transfer_params}


def _for_decode(body: dict) -> dict:
    """The client's body less the fields only the prefill reads (`ttft_slo_ms`)."""
    return {k: v for k, v in body.items() if k != "ttft_slo_ms"}


def export_id(client_id: str) -> str:
    """A fresh export name for one attempt of request `client_id` (the prefill's id rule: 1-128 of [A-Za-z0-9._-],
    not starting with '.'), the client's id recognisable in it."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", client_id)[:100].lstrip(".") or "req"
    return f"{stem}-{uuid.uuid4().hex[:12]}"


def prompt_list(body: dict) -> list | None:
    """The prompts of a list-of-prompts `prompt` (two or more strings, or two or more token-id lists), else None (one
    prompt, or a malformed one — a list mixing text and token ids too — which the prefill server refuses naming
    'prompt', as vLLM does)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) > 1 and (all(isinstance(x, str) for x in p) or
                                               all(isinstance(x, list) for x in p)):
        return p
    return None


def max_prompts() -> int:
    """vLLM's limit on the prompts of one list: $VLLM_MAX_COMPLETION_PROMPTS (read per request, as vLLM reads its
    env), default 1024. ValueError if it is set to something other than an integer."""
    return int(os.environ.get(MAX_PROMPTS_ENV, MAX_PROMPTS_DEFAULT))


def check_prompt_count(body: dict) -> str | None:
    """vLLM's rule on a list `prompt` (completion protocol's `validate_prompt_list_length`, its words): the message
    when it holds more than `max_prompts()` items and is not one prompt of token ids (its first item an int), else
    None."""
    p, limit = body.get("prompt"), max_prompts()
    if not isinstance(p, list) or not p or isinstance(p[0], int) or len(p) <= limit:  # vLLM's is_list_of(p, int)
        return None
    return (f"prompt list length {len(p)} exceeds the maximum allowed count of {limit}. To increase this limit, set "
            f"the {MAX_PROMPTS_ENV} environment variable.")


def merge_answers(answers: list[dict], n: int) -> dict:
    """One vLLM answer for a list of prompts from one answer per prompt (module doc): choices re-indexed prompt ×
    `n` + own index, usage summed."""
    out = dict(answers[0])
    out["choices"] = sorted(({**c, "index": i * n + c.get("index", 0)} for i, a in enumerate(answers)
                             for c in a.get("choices", [])), key=lambda c: c["index"])
    if any(a.get("usage") for a in answers):
        out["usage"] = sum_usage([a.get("usage") for a in answers])
    if "kv_transfer_params" in out or any(a.get("kv_transfer_params") for a in answers):
        out["kv_transfer_params"] = load_status(answers)
    return out


def load_status(answers: list[dict]) -> dict | None:
    """The `kv_transfer_params` an answer to one request reports: the connector's status of each prompt's load
    (`slope_jax_status`, `slope_jax_loaded_tokens`), also where vLLM dropped it — a request that a stop string
    ended finishes in vLLM's front end, before its engine hears of it, so the connector's report never reaches the
    answer (vLLM 0.32): its status then says so, with the cached prompt tokens vLLM's usage counts. For a list of
    prompts, the first prompt's fields with `slope_jax_loaded_tokens` summed over the prompts, `slope_jax_status`
    the prompts' common status (else "mixed: ..."), and every prompt's own in `slope_jax_prompts`. None when no
    answer gives anything to report (e.g. a request vLLM prefilled itself)."""
    each = [_one_status(a) for a in answers]
    if len(each) == 1 or all(p is None for p in each):
        return each[0]
    each = [p or {STATUS_KEY: "unreported"} for p in each]
    statuses = list(dict.fromkeys(str(p.get(STATUS_KEY)) for p in each))
    return {**each[0], LOADED_KEY: sum(p.get(LOADED_KEY) or 0 for p in each),
            STATUS_KEY: statuses[0] if len(statuses) == 1 else "mixed: " + "; ".join(statuses),
            "slope_jax_prompts": each}


def _one_status(answer: dict) -> dict | None:
    params = answer.get("kv_transfer_params")
    if params is not None:
        return params
    if not any(isinstance(c.get("stop_reason"), str) for c in answer.get("choices") or []):
        return None
    cached = ((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {STATUS_KEY: "unreported: a stop string ended the request, and vLLM then drops the connector's report"
                        + ("" if cached is None else f" (vLLM's usage counts {cached} prompt tokens as cached)")}


def sum_usage(usages: list[dict | None]) -> dict:
    """The usage objects added up field by field, nested objects too (`prompt_tokens_details.cached_tokens`,
    `completion_tokens_details.reasoning_tokens`, ...): a numeric field is the sum of the answers that give it, a
    field every answer gives as null stays null, any other value is the first answer's."""
    usages = [u for u in usages if isinstance(u, dict)]
    out = {}
    for key in dict.fromkeys(k for u in usages for k in u):  # every answer's keys, in first-seen order
        given = [u[key] for u in usages if u.get(key) is not None]
        if not given:
            out[key] = None
        elif all(isinstance(v, dict) for v in given):
            out[key] = sum_usage(given)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in given):
            out[key] = sum(given)
        else:
            out[key] = given[0]
    return out


async def _encode(body: dict) -> bytes:
    """`body` as JSON bytes, encoded on a thread (a prompt of hundreds of MB takes seconds to encode: the event loop
    serves other requests meanwhile)."""
    return (await asyncio.to_thread(json.dumps, body)).encode()


def _error(status: int, message: str, param: str | None = None):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                        "proxy_error", "param": param, "code": status}}, status=status)


def _client_id(request, body: dict) -> str:
    rid = request.headers.get("X-Request-Id") or body.get("request_id")
    # no "cmpl-" prefix: vLLM puts it before the request id in its answer's `id` ("cmpl-<32 hex>", as without us)
    return rid if isinstance(rid, str) and rid else uuid.uuid4().hex


class _Prefilled:
    """One prompt's prefill answer: `params` (kv_transfer_params), `first` (the whole answer), `export` (its name)."""

    def __init__(self, params: dict, first: dict, export: str):
        self.params, self.first, self.export = params, first, export


_DIRECT = object()  # `_prefill`'s answer when the prefill server does not serve the request's `model` (a LoRA
# adapter or another name `vllm serve` serves): the decode server prefills it itself (`_direct`)


def _not_served_model(status: int, raw: bytes) -> bool:
    """Whether a prefill answer is its 404 for a `model` it does not serve (`http._check_model`)."""
    if status != 404:
        return False
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(err, dict) and err.get("param") == "model"


async def _prefill(application, body: dict, client_id: str, chat: bool):
    """The prefill of one prompt: a `_Prefilled`, `_DIRECT` (the prefill server does not serve the request's
    `model`), or the error response to give the client."""
    import aiohttp
    from aiohttp import web

    url = application["prefill_url"] + _ROUTES[chat]
    export = export_id(client_id)
    data = await _encode(prefill_body(body, export, chat, application["kv_transport"]))
    try:
        async with application["session"].post(url, data=data, headers={"X-Request-Id": client_id,
                                                                        "Content-Type": "application/json"}) as resp:
            raw = await resp.read()
            if _not_served_model(resp.status, raw):
                return _DIRECT
            if resp.status != 200:  # the prefill's own answer: 4xx naming the field, 503 SLO rejection, ...
                return web.Response(body=raw, status=resp.status, content_type=resp.content_type)
            first = json.loads(raw)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return _error(502, f"the prefill server {url} did not answer: {type(e).__name__}: {e}")
    params = first.get("kv_transfer_params")
    if not isinstance(params, dict):
        return _error(502, f"the prefill server {url} answered without kv_transfer_params")
    logging.info("%s: prefill %d tokens into export %s, first token %s, TTFT %.1f ms", client_id,
                 params.get("num_tokens", -1), export, params.get("slope_jax_first_token"),
                 first.get("ttft_ms", float("nan")))
    _note_files_fallback(application, params, client_id)
    return _Prefilled(params, first, export)


def _note_files_fallback(application, params: dict, client_id: str) -> None:
    """Warn (the first time, then every 100th) when the proxy asks for NIXL but the prefill's answer carries no NIXL
    record: that request's KV goes by files, which needs a filesystem both servers share (the prefill endpoint says
    why at its start-up or per request: NIXL not installed in its environment, its pool full, ...)."""
    if application["kv_transport"] != "nixl" or _NIXL_KEY in params:
        return
    counts = application["fallbacks"]  # a dict made with the app: a started app's own keys are frozen
    n = counts["files"] = counts["files"] + 1
    if n == 1 or n % 100 == 0:
        why = params.get("slope_jax_nixl_unavailable")  # slope_jax.serve.http.NIXL_UNAVAILABLE
        logging.warning("%s: the prefill server answered without a NIXL record (%d such answers so far): %s. The KV "
                        "goes to the decode server by files, which needs a shared filesystem; --kv_transport=files "
                        "silences this.", client_id, n, f"it says: {why}" if why else
                        "check that NIXL is installed where the prefill endpoint runs and read its log")


def _release(application, exports: list[str], consumed: bool) -> None:
    """Tell the prefill server these exports are done with: now if the decode `consumed` them, else after the grace
    period (a load of an abandoned request may still be running). Runs in the background."""
    async def go():
        import aiohttp

        if not consumed:
            await asyncio.sleep(application["release_grace_s"])
        for export in exports:
            try:
                async with application["session"].post(application["prefill_url"] + "/v1/kv/release",
                                                       json={"request_id": export}) as resp:
                    await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                logging.warning("could not release export %s: %s: %s", export, type(e).__name__, e)

    task = asyncio.get_running_loop().create_task(go())
    application["releases"].add(task)
    task.add_done_callback(application["releases"].discard)


_MAX_HEADER_CHARS = 4000  # clients refuse longer header lines (aiohttp: 8190 bytes in all)


def _joined(values: list[str]) -> str:
    """`values` comma-separated, at most `_MAX_HEADER_CHARS` characters: a long list's value keeps the first items
    that fit and ends in ",...(N in all)"."""
    text = ",".join(values)
    if len(text) <= _MAX_HEADER_CHARS:
        return text
    tail = f",...({len(values)} in all)"
    return text[:_MAX_HEADER_CHARS - len(tail)].rsplit(",", 1)[0] + tail


def _answer_headers(client_id: str, done: list[_Prefilled], content_type: str) -> dict:
    """The answer's headers; the X-Slope-Jax-* ones only when slope_jax prefilled (`done` not empty), each at most
    `_MAX_HEADER_CHARS` characters (`_joined`)."""
    if not done:
        return {"Content-Type": content_type, "X-Request-Id": client_id}
    return {"Content-Type": content_type, "X-Request-Id": client_id,
            "X-Slope-Jax-Export": _joined([p.export for p in done]),
            "X-Slope-Jax-First-Token": _joined([str(p.params.get("slope_jax_first_token")) for p in done]),
            "X-Slope-Jax-TTFT-ms": _joined([str(p.first.get("ttft_ms")) for p in done])}


async def _direct(request, body: dict, client_id: str, chat: bool, why: str | None = None):
    """The whole request (a list of prompts too) to the decode server, which prefills it itself: the prefill server
    does not serve its `model` (or, `why`, cannot render its prompt as vLLM would). vLLM answers as it would without
    the proxy (its own 404 if it does not serve the model either)."""
    logging.info("%s: %s: the decode server prefills it itself", client_id,
                 why or f"model {body.get('model')!r} is not the prefill server's")
    return await _relay(request, _for_decode(body), client_id, [], chat)


async def _read_body(request):
    """The request's raw body, or the 413 to answer (OpenAI's error shape, naming the limit and its flag) when it is
    larger than the application's `max_body_mib`."""
    from aiohttp import web

    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app["max_body_mib"]
        return _error(413, f"the request body ({request.content_length or 'more than the limit'} bytes) is larger "
                      f"than the proxy's limit of {limit} MiB (--max_body_mib={limit})")


async def _completions(request, chat: bool = False):
    raw = await _read_body(request)
    if not isinstance(raw, bytes):
        return raw
    try:  # a big body is parsed on a thread: the event loop keeps serving other requests meanwhile
        body = json.loads(raw) if len(raw) < 2**20 else await asyncio.to_thread(json.loads, raw)
    except (ValueError, RecursionError) as e:
        return _error(400, f"the body is not valid JSON ({e})")
    if not isinstance(body, dict):
        return _error(400, f"the body must be a JSON object, got {type(body).__name__}")
    client_id = _client_id(request, body)
    if not chat and (too_many := check_prompt_count(body)) is not None:  # before any prefill, as vLLM refuses it
        return _error(400, too_many, "prompt")
    if chat and body.get("chat_template") is not None:  # the prefill renders the checkpoint's template only, and
        # vLLM would run the prefill's tokens (kv_transfer_params.prompt_token_ids): the client's template is vLLM's
        return await _direct(request, body, client_id, chat, "a request 'chat_template' (vLLM renders it itself)")
    prompts = None if chat else prompt_list(body)
    if prompts is not None:
        return await _fan_out(request, body, client_id, prompts)
    done = await _prefill(request.app, body, client_id, chat)
    if done is _DIRECT:
        return await _direct(request, body, client_id, chat)
    if not isinstance(done, _Prefilled):
        return done
    consumed = False
    try:
        to_decode = decode_body(body, done.params, request.app["kv_transport"])
        response = await _relay(request, to_decode, client_id, [done], chat)
        consumed = response.status == 200
        return response
    finally:  # also when the client left (the handler is cancelled) or the decode failed
        _release(request.app, [done.export], consumed)


async def _relay(request, body: dict, client_id: str, done: list[_Prefilled], chat: bool):
    """Send `body` to the decode server and relay its answer as it comes (server-sent events go on as they arrive);
    a JSON answer to a prefilled request whose load report vLLM dropped gets its status (`load_status`)."""
    url = request.app["decode_url"] + _ROUTES[chat]
    data = await _encode(body)
    if done and not body.get("stream"):
        return await _relay_json(request, url, data, client_id, done)
    return await _stream_answer(
        request, lambda: request.app["session"].post(url, data=data, headers={"X-Request-Id": client_id,
                                                                             "Content-Type": "application/json"}),
        lambda resp: _answer_headers(client_id, done, resp.headers.get("Content-Type", "application/json")),
        url, client_id)


async def _relay_json(request, url: str, data: bytes, client_id: str, done: list[_Prefilled]):
    """A non-streamed answer of the decode server, read whole and relayed with the same status and body, except
    that a 200 JSON answer whose `kv_transfer_params` vLLM left null gets the status `load_status` gives."""
    import aiohttp
    from aiohttp import web

    try:
        async with request.app["session"].post(url, data=data, headers={"X-Request-Id": client_id,
                                                                       "Content-Type": "application/json"}) as resp:
            status, reason, raw, content_type = resp.status, resp.reason, await resp.read(), resp.content_type
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _error(502, f"the decode server {url} did not answer: {type(e).__name__}: {e}")
    headers = _answer_headers(client_id, done, content_type)
    del headers["Content-Type"]
    if status == 200 and content_type == "application/json":
        try:
            answer = json.loads(raw)
        except ValueError:  # relayed as it came
            answer = None
        if isinstance(answer, dict) and answer.get("kv_transfer_params", {}) is None:
            answer["kv_transfer_params"] = load_status([answer])
            raw = json.dumps(answer).encode()
    return web.Response(body=raw, status=status, reason=reason, content_type=content_type, headers=headers)


async def _stream_answer(request, send, headers, url: str, client_id: str):
    """`send()` (a request context to the decode server at `url`) and its answer relayed to the client as it comes:
    status (and reason), `headers(resp)`, the body chunk by chunk. 502 naming `url` when the decode server does not
    answer; once the status line is out, a broken answer is logged and re-raised (aiohttp closes the connection,
    the client sees a cut body)."""
    import aiohttp
    from aiohttp import web

    out = None
    try:
        async with send() as resp:
            out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=headers(resp))
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        if out is None:
            return _error(502, f"the decode server {url} did not answer: {type(e).__name__}: {e}")
        logging.warning("%s: the decode server's answer broke off: %s: %s", client_id, type(e).__name__, e)
        raise


async def _fan_out(request, body: dict, client_id: str, prompts: list):
    """A list of prompts: one prefill, export and decode request per prompt, the answers merged (module doc)."""
    subs = [{**body, "prompt": p} for p in prompts]
    ids = [f"{client_id}-{i}" for i in range(len(prompts))]
    results = await _prefill_list(request.app, subs, ids)
    done = [r for r in results if isinstance(r, _Prefilled)]
    if any(r is _DIRECT for r in results):  # one model for every prompt: none was prefilled
        _release(request.app, [p.export for p in done], True)
        return await _direct(request, body, client_id, False)
    if len(done) < len(results):  # the first prompt's error; the other exports are never decoded
        _release(request.app, [p.export for p in done], True)
        return next(r for r in results if r is not None and not isinstance(r, _Prefilled))
    consumed = False
    try:
        bodies = [decode_body(s, p.params, request.app["kv_transport"]) for s, p in zip(subs, done)]
        if body.get("stream"):
            response = await _fan_out_stream(request, bodies, ids, client_id, done)
        else:
            response = await _fan_out_json(request, bodies, ids, client_id, done, body.get("n") or 1)
        consumed = response.status == 200
        return response
    finally:
        _release(request.app, [p.export for p in done], consumed)


async def _prefill_list(application, subs: list[dict], ids: list[str]) -> list:
    """The prefills of a list's prompts, at most `list_concurrency` in flight (the prefill server queues requests
    in arrival order: a list sent whole would put every other client's request behind all of its prompts). Each
    prompt's `_prefill` answer in order; once one fails (an error, or `_DIRECT`), the prompts not yet started are
    not prefilled (None)."""
    limit, failed = asyncio.Semaphore(application["list_concurrency"]), []

    async def one(sub, rid):
        async with limit:
            if failed:
                return None
            result = await _prefill(application, sub, rid, False)
            if not isinstance(result, _Prefilled):
                failed.append(result)
            return result

    return await asyncio.gather(*(one(s, i) for s, i in zip(subs, ids)))


async def _fan_out_json(request, bodies: list[dict], ids: list[str], client_id: str, done: list, n: int):
    """Non-streamed list: one decode request per prompt, at most `list_concurrency` in flight, the answers merged."""
    import aiohttp
    from aiohttp import web

    url = request.app["decode_url"] + _ROUTES[False]
    limit = asyncio.Semaphore(request.app["list_concurrency"])

    async def one(b, i):
        async with limit, request.app["session"].post(url, json=b, headers={"X-Request-Id": i}) as resp:
            return resp.status, await resp.read(), resp.content_type

    try:
        answers = await asyncio.gather(*(one(b, i) for b, i in zip(bodies, ids)))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _error(502, f"the decode server {url} did not answer: {type(e).__name__}: {e}")
    for status, raw, content_type in answers:
        if status != 200:
            return web.Response(body=raw, status=status, content_type=content_type)
    merged = merge_answers([json.loads(raw) for _, raw, _ in answers], n)
    headers = _answer_headers(client_id, done, "application/json")
    del headers["Content-Type"]
    return web.json_response(merged, headers=headers)


async def _fan_out_stream(request, bodies: list[dict], ids: list[str], client_id: str, done: list):
    """Streamed list: every prompt's events as they arrive, at most `list_concurrency` prompts' decode streams open at
    once, choice indices shifted by prompt × n, usage chunks summed into one, one [DONE]. A decode error before the
    first event is relayed as the decode server sent it; one after it (the status line is out) becomes an error event
    (`data: {"error": ...}`, as vLLM reports an error mid-stream) before the [DONE]."""
    from aiohttp import web

    n = bodies[0].get("n") or 1
    queue: asyncio.Queue = asyncio.Queue()
    limit = asyncio.Semaphore(request.app["list_concurrency"])
    readers = [asyncio.create_task(_stream_one(request.app, limit, b, i, k * n, queue))
               for k, (b, i) in enumerate(zip(bodies, ids))]
    out, usage, last = None, [], None
    try:
        for _ in readers:
            while (item := await queue.get()) is not None:
                if isinstance(item, web.Response) and out is None:  # a decode error before any event: relayed
                    return item
                if out is None:
                    out = web.StreamResponse(headers=_answer_headers(client_id, done, "text/event-stream"))
                    await out.prepare(request)
                if isinstance(item, web.Response):
                    await out.write(b"data: " + item.body + b"\n\n")
                elif not item.get("choices") and item.get("usage"):
                    usage.append(item["usage"])
                    last = item
                else:
                    await out.write(f"data: {json.dumps(item)}\n\n".encode())
    finally:
        for task in readers:
            task.cancel()
    if out is None:
        out = web.StreamResponse(headers=_answer_headers(client_id, done, "text/event-stream"))
        await out.prepare(request)
    if last is not None:
        await out.write(f"data: {json.dumps({**last, 'usage': sum_usage(usage)})}\n\n".encode())
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


async def _stream_one(application, limit: asyncio.Semaphore, body: dict, rid: str, offset: int,
                      queue: asyncio.Queue) -> None:
    """One prompt's decode stream, once `limit` lets it start: its events on `queue` (choice indices + `offset`), or
    its error answer (a `web.Response`: the decode server's, or 502 when it did not answer); None at the end."""
    import aiohttp
    from aiohttp import web

    url = application["decode_url"] + _ROUTES[False]
    try:
        async with limit, application["session"].post(url, json=body, headers={"X-Request-Id": rid}) as resp:
            if resp.status != 200:
                await queue.put(web.Response(body=await resp.read(), status=resp.status,
                                             content_type=resp.content_type))
                return
            await _read_events(resp, offset, queue)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        await queue.put(_error(502, f"the decode server {url} did not answer: {type(e).__name__}: {e}"))
    finally:
        await queue.put(None)


async def _read_events(resp, offset: int, queue: asyncio.Queue) -> None:
    """Put each server-sent event of `resp` (a JSON object, choice indices + `offset`) on `queue`."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            data = raw.decode().removeprefix("data: ").strip()
            if not data or data == "[DONE]":
                continue
            event = json.loads(data)
            for choice in event.get("choices") or []:
                choice["index"] = choice.get("index", 0) + offset
            await queue.put(event)


async def _health(request):
    import aiohttp
    from aiohttp import web

    down = []
    for name in ("prefill_url", "decode_url"):
        try:
            async with request.app["session"].get(request.app[name] + "/health") as resp:
                if resp.status != 200:
                    down.append(f"{request.app[name]} answered {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            down.append(f"{request.app[name]}: {e}")
    if down:
        return web.json_response({"status": "unavailable", "reasons": down}, status=503)
    return web.json_response({"status": "ok"})


async def _models(request):
    """The decode server's /v1/models, relayed; 503 naming it while it cannot be reached (still starting)."""
    import aiohttp
    from aiohttp import web

    try:
        async with request.app["session"].get(request.app["decode_url"] + "/v1/models") as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return _error(503, f"the decode server {request.app['decode_url']} cannot be reached (starting?): {e}")


async def _pass_through(request):
    """Any other method and path (/metrics, /version, /tokenize, /v1/responses, ...): relayed to the decode server
    unchanged — method, path, query string, body and headers (less the hop-by-hop ones) — and its answer back as it
    comes: status, content type and body. 502 when the decode server does not answer."""
    raw = await _read_body(request)
    if not isinstance(raw, bytes):
        return raw
    url = request.app["decode_url"] + request.rel_url.raw_path_qs  # path and query string as the client wrote them
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
    return await _stream_answer(
        request, lambda: request.app["session"].request(request.method, url, data=raw, headers=headers,
                                                        allow_redirects=False),
        lambda resp: {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS},
        url, request.method + " " + request.rel_url.path)


def make_app(prefill_url: str, decode_url: str, timeout_s: float = 3600.0, release_grace_s: float = 30.0,
             kv_transport: str = "nixl", max_body_mib: int = 1024, list_concurrency: int = 4):
    """The proxy's aiohttp application (routes in the module docstring). Serve it with handler_cancellation=True
    (`main` does) so that a client's disconnect cancels its work. `max_body_mib`: the largest body accepted (a larger
    one: 413); `list_concurrency`: the most prefills (then decode requests) of one list of prompts in flight at once.
    ValueError naming the argument when one is out of range."""
    import functools

    import aiohttp
    from aiohttp import web

    for name, value in (("max_body_mib", max_body_mib), ("list_concurrency", list_concurrency)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    application = web.Application(client_max_size=max_body_mib * 2**20)
    application["prefill_url"], application["decode_url"] = prefill_url.rstrip("/"), decode_url.rstrip("/")
    application["release_grace_s"] = release_grace_s
    application["max_body_mib"], application["list_concurrency"] = max_body_mib, list_concurrency
    if kv_transport not in ("nixl", "files"):
        raise ValueError(f"kv_transport={kv_transport!r}: expected 'nixl' or 'files'")
    application["kv_transport"] = kv_transport
    application["releases"] = set()
    application["fallbacks"] = {"files": 0}  # answers without the NIXL record the proxy asked for

    async def session_context(a):
        # no connection limit (aiohttp's default is 100): each open stream holds a connection to the decode server,
        # and a 101st request would wait for one to close, /health too; the servers bound their own concurrency
        a["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                             connector=aiohttp.TCPConnector(limit=0, limit_per_host=0))
        yield
        for task in list(a["releases"]):
            task.cancel()
        await a["session"].close()

    application.cleanup_ctx.append(session_context)
    application.router.add_post("/v1/completions", _completions)
    application.router.add_post("/v1/chat/completions", functools.partial(_completions, chat=True))
    application.router.add_get("/health", _health)
    application.router.add_get("/v1/models", _models)
    application.router.add_route("*", "/{path:.*}", _pass_through)  # last: every route above takes precedence
    return application


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from aiohttp import web

    logging.info("P/D proxy on http://%s:%d: prefill %s, decode %s, KV over %s", FLAGS.host, FLAGS.port,
                 FLAGS.prefill_url, FLAGS.decode_url, FLAGS.kv_transport)
    web.run_app(make_app(FLAGS.prefill_url, FLAGS.decode_url, FLAGS.timeout_s, FLAGS.release_grace_s,
                         FLAGS.kv_transport, FLAGS.max_body_mib, FLAGS.list_concurrency),
                host=FLAGS.host, port=FLAGS.port, access_log=None, print=None, handler_cancellation=True)


def run():
    """Console-script entry (`slope-pd-proxy`) and `python -m slope_jax.serve.pd_proxy`."""
    from slope_jax import cli

    cli.run(main, name="slope_jax.serve.pd_proxy")  # absl's app.run, --help exiting 0, usage errors one line


if __name__ == "__main__":
    run()
