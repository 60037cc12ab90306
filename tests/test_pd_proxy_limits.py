"""The P/D proxy (slope_jax.serve.pd_proxy) under load and at vLLM's edges, against in-process fake prefill and decode
servers (no vLLM, no engine): open streams beyond aiohttp's default pool, long lists of prompts beside small requests,
vLLM's prompt-count limit, big bodies, mixed lists, generated ids, usage sums and routes relayed unchanged; and the
prefill endpoint's reading of `truncate_prompt_tokens` / `truncation_side` and whole-number float token ids
(slope_jax.serve.http.validate)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from support import SHIPPED

from slope_jax.kv.store import KVStore
from slope_jax.serve import http, pd_proxy


def _fakes(seen: dict, prefill_s: float = 0.0):
    """A fake prefill server (one request at a time, in arrival order, `prefill_s` each: a busy engine's queue) and a
    fake decode server. Decode: prompt "hold" streams one event, then waits for `seen["release"]`; others answer
    "<prompt>!" with usage (streamed when asked) and id "cmpl-" + X-Request-Id, as vLLM names its answers. Decode
    also serves /metrics, /tokenize (any method: echoes method, query and body, status 201) and a streamed
    /v1/responses, which the proxy has no routes for."""
    from aiohttp import web

    lock = asyncio.Lock()  # FIFO: the prefill serves its queue in arrival order

    async def prefill(request):
        body = await request.json()
        seen["prefill"].append(body)
        async with lock:
            await asyncio.sleep(prefill_s)
        if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 1 and not all(
                isinstance(x, int) for x in body["prompt"]):
            return web.json_response(http.error_body(400, "request 1: 'prompt' holds 2 prompts", "prompt"), status=400)
        return web.json_response({"choices": [{"text": "a"}], "kv_transfer_params": {
            "slope_jax_kv_path": f"/kv/{body['request_id']}", "slope_jax_first_token": 1, "num_tokens": 1}})

    async def decode(request):
        body = await request.json()
        seen["decode"].append(body)
        if body.get("prompt") == "hold":
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b'data: {"choices": [{"index": 0, "text": "h"}]}\n\n')
            await seen["release"].wait()
            await out.write(b"data: [DONE]\n\n")
            return out
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt.startswith("kv-"):  # the connector's report, as vLLM gives it
            stop = prompt == "kv-stop"  # a stop string ended it: vLLM's front end finished it, the report is lost
            return web.json_response({"id": "cmpl-" + request.headers["X-Request-Id"], "choices": [
                {"index": 0, "text": "!", "finish_reason": "stop", "stop_reason": " x" if stop else None}],
                "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}},
                "kv_transfer_params": None if stop else {"slope_jax_status": "loaded",
                                                         "slope_jax_loaded_tokens": len(prompt)}})
        return web.json_response({"id": "cmpl-" + request.headers["X-Request-Id"], "choices": [
            {"index": 0, "text": f"{body.get('prompt')}!"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                                        "total_tokens": 2}})

    async def anything(request):
        raw = await request.read()
        return web.json_response({"method": request.method, "query": request.rel_url.raw_query_string,
                                  "body": raw.decode()},
                                 status=201, headers={"X-Backend": "decode"})

    async def metrics(request):
        return web.Response(text="vllm:num_requests_running 0\n", content_type="text/plain")

    async def responses(request):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for piece in (b"data: 1\n\n", b"data: 2\n\n"):
            await out.write(piece)
        return out

    async def ok(request):
        return web.json_response({})

    prefill_app, decode_app = web.Application(client_max_size=2**30), web.Application(client_max_size=2**30)
    for a in (prefill_app, decode_app):
        a.router.add_get("/health", ok)
    prefill_app.router.add_post("/v1/completions", prefill)
    prefill_app.router.add_post("/v1/chat/completions", prefill)
    prefill_app.router.add_post("/v1/kv/release", ok)
    decode_app.router.add_post("/v1/completions", decode)
    decode_app.router.add_post("/v1/chat/completions", decode)
    decode_app.router.add_get("/metrics", metrics)
    decode_app.router.add_route("*", "/tokenize", anything)
    decode_app.router.add_post("/v1/responses", responses)
    return prefill_app, decode_app


def _run(check, prefill_s: float = 0.0, **app_options):
    """Run `check(proxy, seen)` against a proxy in front of the fakes (all in this process)."""
    import aiohttp
    from aiohttp.test_utils import TestClient, TestServer

    async def main():
        seen = {"prefill": [], "decode": [], "release": asyncio.Event()}
        backends = [TestServer(a) for a in _fakes(seen, prefill_s)]
        for b in backends:
            await b.start_server()
        app = pd_proxy.make_app(str(backends[0].make_url("")), str(backends[1].make_url("")), release_grace_s=0.1,
                                **app_options)
        # the test's own client pool is unlimited too: it holds more than 100 requests open
        proxy = TestClient(TestServer(app, handler_cancellation=True), connector=aiohttp.TCPConnector(limit=0))
        await proxy.start_server()
        try:
            await check(proxy, seen)
        finally:
            seen["release"].set()
            await proxy.close()
            for b in backends:
                await b.close()

    asyncio.run(main())


def test_more_than_100_open_streams_do_not_hold_up_a_small_request():
    """aiohttp's default client pool (100 connections) made request 106 wait for a stream to end: with 105 streams
    open, a small request and /health answer at once."""
    async def check(proxy, seen):
        streams = [asyncio.create_task(proxy.post("/v1/completions", json={"prompt": "hold", "stream": True}))
                   for _ in range(105)]
        t = time.monotonic()
        while sum(d.get("prompt") == "hold" for d in seen["decode"]) < 105 and time.monotonic() - t < 10:
            await asyncio.sleep(0.05)
        t = time.monotonic()
        r = await asyncio.wait_for(proxy.post("/v1/completions", json={"prompt": "small"}), 10)
        assert r.status == 200 and (await r.json())["choices"][0]["text"] == "small!"
        assert (await asyncio.wait_for(proxy.get("/health"), 10)).status == 200
        assert time.monotonic() - t < 5
        assert sum(d.get("prompt") == "hold" for d in seen["decode"]) == 105  # every stream reached the decode
        seen["release"].set()
        for task in streams:
            r = await task
            assert r.status == 200 and (await r.text()).endswith("data: [DONE]\n\n")

    _run(check)


def test_a_list_of_prompts_leaves_room_for_other_clients():
    """A 200-prompt list sent whole queued every other client's request behind all of its prefills: with at most
    `list_concurrency` of a list's prefills in flight, a small request sent just after the list is served long before
    the list ends (the fake prefill serves one request at a time, in arrival order)."""
    async def check(proxy, seen):
        t0 = time.monotonic()
        big = asyncio.create_task(proxy.post("/v1/completions", json={"prompt": [f"p{i}" for i in range(200)]}))
        while len(seen["prefill"]) < 2:
            await asyncio.sleep(0.005)
        r = await proxy.post("/v1/completions", json={"prompt": "small"})
        small_s = time.monotonic() - t0
        assert r.status == 200 and not big.done()
        r = await big
        list_s = time.monotonic() - t0
        body = await r.json()
        assert r.status == 200 and [c["text"] for c in body["choices"]] == [f"p{i}!" for i in range(200)]
        assert body["usage"] == {"prompt_tokens": 200, "completion_tokens": 200, "total_tokens": 400}
        assert small_s < 0.25 * list_s, (small_s, list_s)
        # 200 export names do not fit a header line: the first ones, then the count
        assert len(r.headers["X-Slope-Jax-Export"]) <= 4000 and r.headers["X-Slope-Jax-Export"].endswith(
            ",...(200 in all)")

    _run(check, prefill_s=0.01)


def test_vllms_limit_on_the_prompts_of_a_list(monkeypatch):
    """More prompts than $VLLM_MAX_COMPLETION_PROMPTS (default 1024): vLLM's 400 naming 'prompt', no prefill; one
    prompt of token ids is no list of prompts, however long."""
    async def check(proxy, seen):
        r = await proxy.post("/v1/completions", json={"prompt": ["x"] * 1025})
        error = (await r.json())["error"]
        assert r.status == 400 and error["param"] == "prompt" and error["message"] == (
            "prompt list length 1025 exceeds the maximum allowed count of 1024. To increase this limit, set the "
            "VLLM_MAX_COMPLETION_PROMPTS environment variable.")
        assert seen["prefill"] == []
        monkeypatch.setenv("VLLM_MAX_COMPLETION_PROMPTS", "3")
        r = await proxy.post("/v1/completions", json={"prompt": [[1], [2], [3], [4]]})
        assert r.status == 400 and "allowed count of 3" in (await r.json())["error"]["message"]
        assert seen["prefill"] == []
        r = await proxy.post("/v1/completions", json={"prompt": ["a", "b", "c"]})
        assert r.status == 200 and len((await r.json())["choices"]) == 3
        r = await proxy.post("/v1/completions", json={"prompt": list(range(5))})  # token ids: one prompt
        assert r.status == 200 and seen["prefill"][-1]["prompt"] == list(range(5))

    _run(check)


def test_a_mixed_list_goes_whole_to_the_prefill_which_refuses_it():
    """A list mixing text and token ids is no list of prompts (vLLM: 400): not fanned out; the prefill's 400 naming
    'prompt' is the answer, and nothing is decoded."""
    assert pd_proxy.prompt_list({"prompt": ["text", [11, 12, 13]]}) is None
    assert pd_proxy.prompt_list({"prompt": [[11], [12, 13]]}) == [[11], [12, 13]]
    assert pd_proxy.prompt_list({"prompt": ["a", "b"]}) == ["a", "b"]

    async def check(proxy, seen):
        r = await proxy.post("/v1/completions", json={"prompt": ["text", [11, 12, 13]]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        assert [p["prompt"] for p in seen["prefill"]] == [["text", [11, 12, 13]]] and seen["decode"] == []

    _run(check)
    limits = dict(model_name="m", vocab_size=1024, max_tokens=100, tokenizer=None, seen_ids=set(), top_k=5,
                  kv_store=None)
    with pytest.raises(http.HttpError) as e:  # the prefill endpoint's own answer to it
        http.validate(b'{"prompt": ["text", [11, 12, 13]]}', {}, 1, **limits)
    assert (e.value.status, e.value.param) == (400, "prompt") and "mixes text and token-id lists" in str(e.value)


def test_a_generated_request_id_gives_vllms_answer_id():
    """No client id: the proxy's id is 32 hex digits, so vLLM's answer id is "cmpl-<32 hex>", not "cmpl-cmpl-..."."""
    async def check(proxy, seen):
        r = await proxy.post("/v1/completions", json={"prompt": "hi"})
        answer_id = (await r.json())["id"]
        assert answer_id == "cmpl-" + r.headers["X-Request-Id"] and not answer_id.startswith("cmpl-cmpl-")
        assert len(answer_id) == len("cmpl-") + 32 and int(answer_id[len("cmpl-"):], 16) >= 0

    _run(check)


def test_usage_of_a_list_sums_every_numeric_field():
    """Every numeric usage field is summed, nested ones too; a field every answer gives as null stays null."""
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 2, "created_cache_tokens": 1, "multimodal_tokens": None},
             "completion_tokens_details": {"reasoning_tokens": 2, "accepted_prediction_tokens": None}}
    other = {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
             "prompt_tokens_details": {"cached_tokens": None, "created_cache_tokens": 3, "multimodal_tokens": None},
             "completion_tokens_details": None}
    assert pd_proxy.sum_usage([usage, None, other]) == {
        "prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 2, "created_cache_tokens": 4, "multimodal_tokens": None},
        "completion_tokens_details": {"reasoning_tokens": 2, "accepted_prediction_tokens": None}}


def test_a_body_over_64_mib_is_accepted_and_one_over_the_limit_gets_a_json_413():
    """The proxy takes bodies up to --max_body_mib (default 1024 MiB; it refused more than 64 MiB in plain text);
    over the limit, an OpenAI-shaped 413 naming the limit and the flag."""
    big = {"prompt": "hi", "user": "x" * (65 * 2**20)}  # a decode-only field: the prefill never sees it

    async def check(proxy, seen):
        r = await proxy.post("/v1/completions", data=json.dumps(big), headers={"Content-Type": "application/json"})
        assert r.status == 200 and len(seen["decode"][-1]["user"]) == 65 * 2**20
        assert "user" not in seen["prefill"][-1]

    _run(check)

    async def check_small_limit(proxy, seen):
        r = await proxy.post("/v1/completions", data=b'{"prompt": "' + b"x" * (2 * 2**20) + b'"}')
        error = (await r.json())["error"]
        assert r.status == 413 and "limit of 1 MiB" in error["message"] and "--max_body_mib" in error["message"]
        assert seen["prefill"] == []

    _run(check_small_limit, max_body_mib=1)
    with pytest.raises(ValueError, match="max_body_mib"):
        pd_proxy.make_app("http://a", "http://b", max_body_mib=0)


def test_routes_the_proxy_does_not_have_are_relayed_to_the_decode_server():
    """/metrics, /tokenize, /v1/responses ... (vLLM serves them): method, path, query string and body go to the
    decode server unchanged; its status, content type, headers and body come back (streamed as they come)."""
    async def check(proxy, seen):
        r = await proxy.get("/metrics")
        assert r.status == 200 and r.content_type == "text/plain" and "num_requests_running" in await r.text()
        for method in ("POST", "PUT", "GET"):
            r = await proxy.request(method, "/tokenize?a=1&b=x%20y", data=b'{"prompt": "hi"}')
            assert r.status == 201 and r.headers["X-Backend"] == "decode"
            assert await r.json() == {"method": method, "query": "a=1&b=x%20y", "body": '{"prompt": "hi"}'}
        r = await proxy.post("/v1/responses", json={"input": "hi", "stream": True})
        assert r.status == 200 and r.content_type == "text/event-stream" and await r.text() == "data: 1\n\ndata: 2\n\n"
        r = await proxy.get("/nowhere")
        assert r.status == 404  # the decode server's own answer

    _run(check)


def test_a_chat_request_with_its_own_template_goes_to_vllm_whole():
    """The prefill renders the checkpoint's template only, and vLLM runs the prefill's token ids: a request's own
    `chat_template` would have been dropped silently. Such a request now goes to vLLM whole (vLLM renders it, under
    its own rules); `reasoning_effort`, which templates read, reaches the prefill."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}
    assert pd_proxy.prefill_body(chat, "e", chat=True)["reasoning_effort"] == "low"

    async def check(proxy, seen):
        body = {**chat, "chat_template": "{{ messages[0].content }}"}
        r = await proxy.post("/v1/chat/completions", json=body)
        assert r.status == 200 and "X-Slope-Jax-Export" not in r.headers
        assert seen["prefill"] == [] and seen["decode"] == [body]  # unchanged: no kv_transfer_params

    _run(check)


def test_the_prefill_renders_reasoning_effort_as_vllm_does(tmp_path):
    """vLLM passes `reasoning_effort` (and `enable_thinking` = effort != "none", unless chat_template_kwargs sets it)
    to the template, over chat_template_kwargs; the prefill dropped it, and vLLM then ran the prefill's tokens."""
    limits = _limits(tmp_path, max_tokens=1000)
    template = http.ChatTemplate("{{ messages[0].content }}|{{ reasoning_effort }}|{{ enable_thinking }}|"
                                 "{{ add_generation_prompt }}", {})

    def rendered(number, **fields):
        body = {"messages": [{"role": "user", "content": "hi"}], **fields}
        ids = http.validate(json.dumps(body).encode(), {}, number, chat=True, chat_template=template,
                            **limits).request.tokens.tolist()
        return limits["tokenizer"].decode(ids)

    assert rendered(1, reasoning_effort="high") == "hi|high|True|True"
    assert rendered(2, reasoning_effort="none") == "hi|none|False|True"
    assert rendered(3, reasoning_effort="low", chat_template_kwargs={"enable_thinking": False,
                                                                     "reasoning_effort": "high"}) == "hi|low|False|True"
    assert rendered(4, chat_template_kwargs={"add_generation_prompt": False}) == "hi|||True"  # the field wins
    with pytest.raises(http.HttpError) as e:
        rendered(5, reasoning_effort="extreme")
    assert (e.value.status, e.value.param) == (400, "reasoning_effort")
    assert str(e.value).startswith("request 5: 'reasoning_effort' must be one of"), str(e.value)  # named once


def test_truncation_fields_go_to_the_prefill():
    """`truncate_prompt_tokens` and `truncation_side` reach the prefill (both routes): it tokenizes, so it truncates."""
    body = {"prompt": "p", "messages": [], "truncate_prompt_tokens": 7, "truncation_side": "right", "top_p": 0.5}
    for chat in (False, True):
        out = pd_proxy.prefill_body(body, "e", chat)
        assert (out["truncate_prompt_tokens"], out["truncation_side"]) == (7, "right") and "top_p" not in out


# ---- the prefill endpoint's boundary ----------------------------------------------------------------------------
def _limits(tmp_path, max_tokens: int = 100) -> dict:
    from tokenizers import Tokenizer

    return dict(model_name="tiny", vocab_size=1024, max_tokens=max_tokens, seen_ids=set(), top_k=5,
                kv_store=KVStore(str(tmp_path)),
                tokenizer=Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json")))


def _template():
    return http.ChatTemplate("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
                             "{% endfor %}", {})


def test_validate_truncates_the_prompt_as_vllm_does(tmp_path):
    """vLLM's truncation (its TokenizeParams, generate models): keep the last N tokens ("left", the default) or the
    first N ("right"); -1 keeps the limit less one; a longer prompt is cut before the length limit applies; chat too."""
    limits = _limits(tmp_path)
    ids = [(7 * i) % 1000 + 1 for i in range(300)]  # 300 tokens, three times the limit

    def tokens(number, chat=False, **fields):
        body = {"messages": [{"role": "user", "content": "hi " * 200}]} if chat else {"prompt": ids}
        return http.validate(json.dumps({**body, **fields}).encode(), {}, number, chat=chat,
                             chat_template=_template(), **limits).request.tokens.tolist()

    assert tokens(1, truncate_prompt_tokens=10) == ids[-10:]
    assert tokens(2, truncate_prompt_tokens=10, truncation_side="left") == ids[-10:]
    assert tokens(3, truncate_prompt_tokens=10, truncation_side="right") == ids[:10]
    assert tokens(4, truncate_prompt_tokens=-1) == ids[-99:]
    assert tokens(5, truncate_prompt_tokens=100, truncation_side=None) == ids[-100:]
    assert tokens(6, prompt=ids[:5], truncate_prompt_tokens=50) == ids[:5]  # shorter: unchanged
    assert tokens(13, truncate_prompt_tokens=10.0) == ids[-10:]  # a whole-number float, as vLLM (pydantic) reads it
    assert http.validate(json.dumps({"prompt": ids[:5], "logprobs": 2.0}).encode(), {}, 14, **limits).logprobs == 2
    assert tokens(7, prompt="It was the best of times", truncate_prompt_tokens=2) == \
        limits["tokenizer"].encode("It was the best of times").ids[-2:]
    chat = tokens(8, chat=True, truncate_prompt_tokens=20, truncation_side="right")
    assert len(chat) == 20 and chat == tokens(9, chat=True, truncate_prompt_tokens=100, truncation_side="right")[:20]
    assert tokens(10, chat=True, truncate_prompt_tokens=20) == tokens(11, chat=True, truncate_prompt_tokens=100)[-20:]
    with pytest.raises(http.HttpError) as e:  # without truncation the limit holds
        tokens(12)
    assert (e.value.status, e.value.param) == (400, "prompt")


@pytest.mark.parametrize("fields, param, words", [
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "an integer >= -1"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens", "an integer >= -1"),
    ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens", "an integer >= -1"),
    ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens", "an integer >= -1"),
    ({"truncate_prompt_tokens": 101}, "truncate_prompt_tokens", "at most 100 (--max_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "nothing of the prompt"),
    ({"truncate_prompt_tokens": 5, "truncation_side": "middle"}, "truncation_side", "'left' or 'right'"),
    ({"truncation_side": 1}, "truncation_side", "'left' or 'right'"),
])
def test_validate_names_a_bad_truncation_field(tmp_path, fields, param, words):
    with pytest.raises(http.HttpError) as e:
        http.validate(json.dumps({"prompt": [1, 2, 3], **fields}).encode(), {}, 3, **_limits(tmp_path))
    assert (e.value.status, e.value.param) == (400, param) and f"'{param}'" in str(e.value) and words in str(e.value)


def test_validate_takes_whole_number_float_token_ids(tmp_path):
    """vLLM (pydantic's lax mode) takes 10.0 for the token id 10: so does the endpoint; 10.5 is still refused naming
    'prompt'."""
    limits = _limits(tmp_path)
    for number, prompt in enumerate(([10.0, 20.0, 3], [[10.0, 20.0, 3]]), 1):
        v = http.validate(json.dumps({"prompt": prompt}).encode(), {}, number, **limits)
        assert v.request.tokens.tolist() == [10, 20, 3] and json.loads(v.line)["tokens"] == [10, 20, 3]
    for number, prompt in enumerate(([10.5], [1, 2.5], [1e30], [True]), 3):
        with pytest.raises(http.HttpError) as e:
            http.validate(json.dumps({"prompt": prompt}).encode(), {}, number, **limits)
        assert (e.value.status, e.value.param) == (400, "prompt"), str(e.value)


def test_the_answer_reports_every_prompts_load_also_where_vllm_drops_it():
    """The connector's status reaches the client for each prompt: vLLM drops it from a request a stop string ended
    (its front end finishes it; the answer had `kv_transfer_params: null`, so nobody could tell loaded from
    recomputed), and a list's answer carried the first prompt's only (39 tokens loaded of 178)."""
    unreported = ("unreported: a stop string ended the request, and vLLM then drops the connector's report (vLLM's "
                  "usage counts 4 prompt tokens as cached)")

    async def check(proxy, seen):
        r = await proxy.post("/v1/completions", json={"prompt": "kv-stop", "stop": [" x"]})
        body = await r.json()
        assert r.status == 200 and body["kv_transfer_params"] == {"slope_jax_status": unreported}, body
        assert body["choices"][0]["stop_reason"] == " x" and r.headers["X-Slope-Jax-Export"]
        r = await proxy.post("/v1/completions", json={"prompt": "kv-loaded"})
        assert (await r.json())["kv_transfer_params"] == {"slope_jax_status": "loaded", "slope_jax_loaded_tokens": 9}
        r = await proxy.post("/v1/completions", json={"prompt": ["kv-a", "kv-bb"]})
        ktp = (await r.json())["kv_transfer_params"]
        assert (ktp["slope_jax_status"], ktp["slope_jax_loaded_tokens"]) == ("loaded", 9), ktp
        assert [p["slope_jax_loaded_tokens"] for p in ktp["slope_jax_prompts"]] == [4, 5]
        r = await proxy.post("/v1/completions", json={"prompt": ["kv-a", "kv-stop"]})
        ktp = (await r.json())["kv_transfer_params"]
        assert ktp["slope_jax_status"] == "mixed: loaded; " + unreported and ktp["slope_jax_loaded_tokens"] == 4
        r = await proxy.post("/v1/completions", json={"prompt": "plain"})  # no report given: the answer unchanged
        assert "kv_transfer_params" not in await r.json()

    _run(check)
