r"""`python -m slope_jax.serve.pd_proxy`: the P/D proxy. One client request → the slope_jax prefill endpoint
(`slope-jax --http_port`, `slope_jax.serve.http`) → a `vllm serve` decode server that loads the export with
`SlopeJaxConnector` → the decode server's answer back to the client, streamed (`"stream": true`, server-sent events)
or as one JSON body, exactly as the decode server sent it.

  python -m slope_jax.serve.pd_proxy --port=8000 --prefill_url=http://127.0.0.1:8100 --decode_url=http://127.0.0.1:8200
  curl -s 127.0.0.1:8000/v1/completions -d '{"prompt": "It was the best of times", "max_tokens": 16}'

Routes: POST /v1/completions and /v1/chat/completions; GET /health (200 when both servers answer theirs);
GET /v1/models (the decode server's).

Transparent: whatever `vllm serve` accepts the proxy passes on. The flow is vLLM's own disaggregated-serving proxy's
(vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py):
- The prefill server gets only what it reads — the prompt (`prompt`, or `messages` and the chat-template options),
  `model`, `ttft_slo_ms`, `cache_salt` — with max_tokens=1, stream=false, kv_transfer_params {"do_remote_decode":
  true} and the export's name as `request_id`; sampling options, structured outputs (`structured_outputs`,
  `response_format`, ...), `n`/`best_of`, `echo`, `logprobs`/`prompt_logprobs` and anything else never reach it.
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
  serve either); the answer has no X-Slope-Jax-* headers.
- A list of prompts (`"prompt": ["a", "b"]` or token-id lists) is fanned out: one prefill per prompt, each with its
  own export, then one decode request per prompt (vLLM applies one request's kv_transfer_params to every prompt of
  a list, so a list cannot carry one export per prompt). The answers are merged as vLLM answers a list: choice
  `index` = prompt index × n + the choice's own index, usage summed (cached_tokens too), the first answer's id and
  kv_transfer_params; streamed, the events of all prompts are interleaved as they arrive with the same indices,
  one summed usage chunk (if asked) and one `[DONE]`.
- Request ids: the client's X-Request-Id header (else its body's `request_id`, else "cmpl-<32 hex>") goes to the
  decode server unchanged (prompt i of a list: "<id>-<i>", as vLLM names them) and back in the answer's
  X-Request-Id. The export is named per attempt, "<id, reduced to [A-Za-z0-9._-], at most 100 characters>-<12
  hex>", so a retry with the same id is a new export, never the first one's KV; the answer's X-Slope-Jax-Export
  names it (comma-separated for a list), beside X-Slope-Jax-First-Token and X-Slope-Jax-TTFT-ms (the prefill's).
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
import contextlib
import json
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

# what the prefill server reads (`slope_jax.serve.http`); nothing else of the client's body is sent there
_FOR_PREFILL = ("prompt", "model", "ttft_slo_ms", "cache_salt")
_FOR_PREFILL_CHAT = ("messages", "model", "ttft_slo_ms", "cache_salt", "add_generation_prompt",
                     "continue_final_message", "chat_template_kwargs", "tools", "documents")
_ROUTES = {False: "/v1/completions", True: "/v1/chat/completions"}
_NIXL_KEY = "slope_jax_nixl"  # slope_jax.kv.nixl_transport.PARAMS_KEY (not imported: the proxy needs no NIXL)


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
    """The prompts of a list-of-prompts `prompt` (two or more strings or token-id lists), else None (one prompt, or
    a malformed one the prefill server will name)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        return p
    return None


def merge_answers(answers: list[dict], n: int) -> dict:
    """One vLLM answer for a list of prompts from one answer per prompt (module doc): choices re-indexed prompt ×
    `n` + own index, usage summed."""
    out = dict(answers[0])
    out["choices"] = sorted(({**c, "index": i * n + c.get("index", 0)} for i, a in enumerate(answers)
                             for c in a.get("choices", [])), key=lambda c: c["index"])
    if any(a.get("usage") for a in answers):
        out["usage"] = sum_usage([a.get("usage") for a in answers])
    return out


def sum_usage(usages: list[dict | None]) -> dict:
    """Token counts added up (prompt_tokens_details.cached_tokens too, when given)."""
    usages = [u for u in usages if u]
    out = {k: sum(u.get(k) or 0 for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in usages]
    if any(c is not None for c in cached):
        out["prompt_tokens_details"] = {"cached_tokens": sum(c or 0 for c in cached)}
    return out


def _error(status: int, message: str, param: str | None = None):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                        "proxy_error", "param": param, "code": status}}, status=status)


def _client_id(request, body: dict) -> str:
    rid = request.headers.get("X-Request-Id") or body.get("request_id")
    return rid if isinstance(rid, str) and rid else f"cmpl-{uuid.uuid4().hex}"


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
    try:
        async with application["session"].post(url, json=prefill_body(body, export, chat,
                                                                              application["kv_transport"]),
                                               headers={"X-Request-Id": client_id}) as resp:
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
        logging.warning("%s: the prefill server answered without a NIXL record (%d such answers so far): the KV goes "
                        "to the decode server by files, which needs a shared filesystem. Check that NIXL is "
                        "installed where the prefill endpoint runs and read its log; --kv_transport=files "
                        "silences this.", client_id, n)


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


def _answer_headers(client_id: str, done: list[_Prefilled], content_type: str) -> dict:
    """The answer's headers; the X-Slope-Jax-* ones only when slope_jax prefilled (`done` not empty)."""
    if not done:
        return {"Content-Type": content_type, "X-Request-Id": client_id}
    return {"Content-Type": content_type, "X-Request-Id": client_id,
            "X-Slope-Jax-Export": ",".join(p.export for p in done),
            "X-Slope-Jax-First-Token": ",".join(str(p.params.get("slope_jax_first_token")) for p in done),
            "X-Slope-Jax-TTFT-ms": ",".join(str(p.first.get("ttft_ms")) for p in done)}


async def _direct(request, body: dict, client_id: str, chat: bool):
    """The whole request (a list of prompts too) to the decode server, which prefills it itself: the prefill server
    does not serve its `model`. vLLM answers as it would without the proxy (its own 404 if it does not serve it
    either)."""
    logging.info("%s: model %r is not the prefill server's: the decode server prefills it itself", client_id,
                 body.get("model"))
    return await _relay(request, _for_decode(body), client_id, [], chat)


async def _completions(request, chat: bool = False):
    try:
        body = json.loads(await request.read())
    except ValueError as e:
        return _error(400, f"the body is not valid JSON ({e})")
    if not isinstance(body, dict):
        return _error(400, f"the body must be a JSON object, got {type(body).__name__}")
    client_id = _client_id(request, body)
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
    """Send `body` to the decode server and relay its answer as it comes (server-sent events go on as they arrive)."""
    import aiohttp
    from aiohttp import web

    url = request.app["decode_url"] + _ROUTES[chat]
    out = None
    try:
        async with request.app["session"].post(url, json=body, headers={"X-Request-Id": client_id}) as resp:
            out = web.StreamResponse(status=resp.status, headers=_answer_headers(
                client_id, done, resp.headers.get("Content-Type", "application/json")))
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        if out is None:
            return _error(502, f"the decode server {url} did not answer: {type(e).__name__}: {e}")
        logging.warning("%s: the decode server's answer broke off: %s: %s", client_id, type(e).__name__, e)
        raise  # the status line is out already: aiohttp closes the connection, the client sees a cut body


async def _fan_out(request, body: dict, client_id: str, prompts: list):
    """A list of prompts: one prefill, export and decode request per prompt, the answers merged (module doc)."""
    subs = [{**body, "prompt": p} for p in prompts]
    ids = [f"{client_id}-{i}" for i in range(len(prompts))]
    results = await asyncio.gather(*(_prefill(request.app, s, i, False) for s, i in zip(subs, ids)))
    done = [r for r in results if isinstance(r, _Prefilled)]
    if any(r is _DIRECT for r in results):  # one model for every prompt: none was prefilled
        _release(request.app, [p.export for p in done], True)
        return await _direct(request, body, client_id, False)
    if len(done) < len(results):  # the first prompt's error; the other exports are never decoded
        _release(request.app, [p.export for p in done], True)
        return next(r for r in results if not isinstance(r, _Prefilled))
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


async def _fan_out_json(request, bodies: list[dict], ids: list[str], client_id: str, done: list, n: int):
    import aiohttp
    from aiohttp import web

    url = request.app["decode_url"] + _ROUTES[False]

    async def one(b, i):
        async with request.app["session"].post(url, json=b, headers={"X-Request-Id": i}) as resp:
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
    """Streamed list: every prompt's events as they arrive, choice indices shifted by prompt × n, usage chunks
    summed into one, one [DONE]."""
    from aiohttp import web

    url = request.app["decode_url"] + _ROUTES[False]
    async with contextlib.AsyncExitStack() as stack:
        resps = [await stack.enter_async_context(request.app["session"].post(url, json=b, headers={"X-Request-Id": i}))
                 for b, i in zip(bodies, ids)]
        for resp in resps:
            if resp.status != 200:
                return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)
        out = web.StreamResponse(headers=_answer_headers(client_id, done, "text/event-stream"))
        await out.prepare(request)
        n = bodies[0].get("n") or 1
        queue: asyncio.Queue = asyncio.Queue()
        readers = [asyncio.create_task(_read_events(r, i * n, queue)) for i, r in enumerate(resps)]
        usage, last = [], None
        try:
            for _ in readers:
                while (event := await queue.get()) is not None:
                    if not event.get("choices") and event.get("usage"):
                        usage.append(event["usage"])
                        last = event
                    else:
                        await out.write(f"data: {json.dumps(event)}\n\n".encode())
        finally:
            for task in readers:
                task.cancel()
        if last is not None:
            await out.write(f"data: {json.dumps({**last, 'usage': sum_usage(usage)})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def _read_events(resp, offset: int, queue: asyncio.Queue) -> None:
    """Put each server-sent event of `resp` (a JSON object, choice indices + `offset`) on `queue`; None at the end."""
    buffer = b""
    try:
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
    finally:
        await queue.put(None)


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


def make_app(prefill_url: str, decode_url: str, timeout_s: float = 3600.0, release_grace_s: float = 30.0,
             kv_transport: str = "nixl"):
    """The proxy's aiohttp application (routes in the module docstring). Serve it with handler_cancellation=True
    (`main` does) so that a client's disconnect cancels its work."""
    import functools

    import aiohttp
    from aiohttp import web

    application = web.Application(client_max_size=64 * 2**20)
    application["prefill_url"], application["decode_url"] = prefill_url.rstrip("/"), decode_url.rstrip("/")
    application["release_grace_s"] = release_grace_s
    if kv_transport not in ("nixl", "files"):
        raise ValueError(f"kv_transport={kv_transport!r}: expected 'nixl' or 'files'")
    application["kv_transport"] = kv_transport
    application["releases"] = set()
    application["fallbacks"] = {"files": 0}  # answers without the NIXL record the proxy asked for

    async def session_context(a):
        a["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
        yield
        for task in list(a["releases"]):
            task.cancel()
        await a["session"].close()

    application.cleanup_ctx.append(session_context)
    application.router.add_post("/v1/completions", _completions)
    application.router.add_post("/v1/chat/completions", functools.partial(_completions, chat=True))
    application.router.add_get("/health", _health)
    application.router.add_get("/v1/models", _models)
    return application


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from aiohttp import web

    logging.info("P/D proxy on http://%s:%d: prefill %s, decode %s, KV over %s", FLAGS.host, FLAGS.port,
                 FLAGS.prefill_url, FLAGS.decode_url, FLAGS.kv_transport)
    web.run_app(make_app(FLAGS.prefill_url, FLAGS.decode_url, FLAGS.timeout_s, FLAGS.release_grace_s,
                         FLAGS.kv_transport),
                host=FLAGS.host, port=FLAGS.port, access_log=None, print=None, handler_cancellation=True)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
