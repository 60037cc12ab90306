r"""`python -m slope_jax.serve.pd_proxy`: the P/D proxy. One client completion request → the slope_jax prefill
endpoint (`slope-jax --http_port`, `slope_jax.serve.http`) → a `vllm serve` decode server that loads the export with
`SlopeJaxConnector` → the decode server's answer back to the client, streamed (`"stream": true`, server-sent events)
or as one JSON body, exactly as the decode server sent it.

  python -m slope_jax.serve.pd_proxy --port=8000 --prefill_url=http://127.0.0.1:8100 --decode_url=http://127.0.0.1:8200
  curl -s 127.0.0.1:8000/v1/completions -d '{"prompt": "It was the best of times", "max_tokens": 16}'

The flow is vLLM's own disaggregated-serving proxy's (vllm tests/v1/kv_connector/nixl_integration/toy_proxy_server.py):
the client's body goes to the prefill server with max_tokens=1, stream=false and kv_transfer_params
{"do_remote_decode": true} (less what only decoding uses: logprobs, stream_options, min_tokens); the prefill's
`kv_transfer_params` (the export's path, first token, token count and token hash) replace the client's in the
otherwise unchanged body sent to the decode server. Both get the same X-Request-Id (the client's, else a new one),
which names the KV export. A prefill error (4xx naming the field, 503 SLO rejection, ...) is relayed to the client
unchanged, and nothing is sent to the decode server. Answer headers add X-Slope-Jax-First-Token and
X-Slope-Jax-TTFT-ms (the prefill's). `GET /health` is 200 when both servers answer theirs; `GET /v1/models` is the
decode server's.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_string("prefill_url", "http://127.0.0.1:8100", "Base URL of the slope_jax prefill endpoint.")
flags.DEFINE_string("decode_url", "http://127.0.0.1:8200", "Base URL of the `vllm serve` decode server (started "
                    "with --kv-transfer-config naming SlopeJaxConnector).")
flags.DEFINE_float("timeout_s", 3600.0, "Longest a request may take end to end (prefill queue included).")

# what only the decode server acts on: sent to the prefill, these would constrain it for nothing (e.g. `logprobs`
# beyond the prefill's --top_k)
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens", "logprobs")


def prefill_body(body: dict) -> dict:
    """The body sent to the prefill server: the client's (less the decode-only fields in `_NOT_FOR_PREFILL`), for one
    token, not streamed, asking for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    """The body sent to the decode server: the client's (less the prefill-only `ttft_slo_ms`), with the prefill's
    kv_transfer_params."""
    return {**{k: v for k, v in body.items() if k != "ttft_slo_ms"}, "kv_transfer_params": kv_transfer_params}


def _error(status: int, message: str, param: str | None = None):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                        "proxy_error", "param": param, "code": status}}, status=status)


async def _completions(request):
    import aiohttp
    from aiohttp import web

    session = request.app["session"]
    try:
        body = json.loads(await request.read())
    except ValueError as e:
        return _error(400, f"the body is not valid JSON ({e})")
    if not isinstance(body, dict):
        return _error(400, f"the body must be a JSON object, got {type(body).__name__}")
    rid = request.headers.get("X-Request-Id") or (body.get("request_id") if isinstance(body.get("request_id"), str)
                                                  else None) or f"cmpl-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": rid}
    prefill = request.app["prefill_url"] + "/v1/completions"
    try:
        async with session.post(prefill, json=prefill_body(body), headers=headers) as resp:
            raw = await resp.read()
            if resp.status != 200:  # the prefill's own answer: 4xx naming the field, 503 SLO rejection, ...
                return web.Response(body=raw, status=resp.status, content_type=resp.content_type)
            first = json.loads(raw)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return _error(502, f"the prefill server {prefill} did not answer: {type(e).__name__}: {e}")
    params = first.get("kv_transfer_params")
    if not isinstance(params, dict):
        return _error(502, f"the prefill server {prefill} answered without kv_transfer_params")
    logging.info("%s: prefill %d tokens, first token %s, TTFT %.1f ms", rid, params.get("num_tokens", -1),
                 params.get("slope_jax_first_token"), first.get("ttft_ms", float("nan")))
    decode = request.app["decode_url"] + "/v1/completions"
    out = None
    try:
        async with session.post(decode, json=decode_body(body, params), headers=headers) as resp:
            out = web.StreamResponse(status=resp.status, headers={
                "Content-Type": resp.headers.get("Content-Type", "application/json"), "X-Request-Id": rid,
                "X-Slope-Jax-First-Token": str(params.get("slope_jax_first_token")),
                "X-Slope-Jax-TTFT-ms": str(first.get("ttft_ms"))})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():  # server-sent events go on as they arrive
                await out.write(chunk)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        if out is None:
            return _error(502, f"the decode server {decode} did not answer: {type(e).__name__}: {e}")
        logging.warning("%s: the decode server's answer broke off: %s: %s", rid, type(e).__name__, e)
        raise  # the status line is out already: aiohttp closes the connection, the client sees a cut body


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
    from aiohttp import web

    async with request.app["session"].get(request.app["decode_url"] + "/v1/models") as resp:
        return web.Response(body=await resp.read(), status=resp.status, content_type=resp.content_type)


def make_app(prefill_url: str, decode_url: str, timeout_s: float = 3600.0):
    """The proxy's aiohttp application (routes in the module docstring)."""
    import aiohttp
    from aiohttp import web

    application = web.Application(client_max_size=64 * 2**20)
    application["prefill_url"], application["decode_url"] = prefill_url.rstrip("/"), decode_url.rstrip("/")

    async def session_context(a):
        a["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))
        yield
        await a["session"].close()

    application.cleanup_ctx.append(session_context)
    application.router.add_post("/v1/completions", _completions)
    application.router.add_get("/health", _health)
    application.router.add_get("/v1/models", _models)
    return application


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from aiohttp import web

    logging.info("P/D proxy on http://%s:%d: prefill %s, decode %s", FLAGS.host, FLAGS.port, FLAGS.prefill_url,
                 FLAGS.decode_url)
    web.run_app(make_app(FLAGS.prefill_url, FLAGS.decode_url, FLAGS.timeout_s), host=FLAGS.host, port=FLAGS.port,
                access_log=None, print=None)


def run():
    app.run(main)


if __name__ == "__main__":
    run()
