"""The prefill endpoint (`slope-jax --http_port`, slope_jax.serve.http) and the P/D proxy (slope_jax.serve.pd_proxy),
without vLLM: the request rules over HTTP (status and field per rule), the answer's logprobs against a float64
log-softmax, the proxy's request flow against stand-in servers, and the launcher serving HTTP on two processes
(first token and logprob against transformers in float32, the export on disk, 4xx/404/409/503 answers, concurrent
requests routed by id)."""

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import numpy as np
import pytest
from support import REPO, SHIPPED, free_port, launcher_env

from slope_jax.kv import format as kvfmt
from slope_jax.kv.store import KVStore
from slope_jax.serve import http, pd_proxy, summary
from slope_jax.serve import requests as requests_lib
from slope_jax.serve.front import Front, Intake
from slope_jax.serve.scheduler import Scheduler, slo_stats

W = 32  # the shipped checkpoint's sliding window
VOCAB = 1024
TOP_K = 5
COMMON = ["--dtype=float32", "--q_tile=32", "--kv_tile=32", "--moe_tile=32", "--heartbeat_timeout=10",
          "--init_timeout=120"]

# (body, HTTP status, the field the error names): every rule of the request boundary and of the endpoint
MALFORMED = [
    (b'{"prompt": [1, 2', 400, None),                                               # not JSON
    (b'{"prompt": [1], "ttft_slo_ms": NaN}', 400, None),                            # strict JSON
    (b'\xff{"prompt": [1]}', 400, None),                                            # not UTF-8
    (b'[1, 2, 3]', 400, None),                                                      # not an object
    (b'{"max_tokens": 1}', 400, "prompt"),                                          # prompt rules
    (b'{"prompt": []}', 400, "prompt"),
    (b'{"prompt": ""}', 400, "prompt"),
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"prompt": [1, 1024]}', 400, "prompt"),
    (b'{"prompt": [-1]}', 400, "prompt"),
    (b'{"prompt": [1, 2.5]}', 400, "prompt"),
    (b'{"prompt": [true]}', 400, "prompt"),
    (b'{"prompt": ["a", "b"]}', 400, "prompt"),
    (b'{"prompt": [[1], [2]]}', 400, "prompt"),
    (b'{"prompt": [1, 18446744073709551616]}', 400, "prompt"),
    (b'{"prompt": "x \\ud800 y"}', 400, "prompt"),
    (json.dumps({"prompt": [5] * 101}).encode(), 400, "prompt"),                   # over --max_tokens
    (b'{"prompt": [1], "max_tokens": 16}', 400, "max_tokens"),                      # endpoint rules
    (b'{"prompt": [1], "max_tokens": true}', 400, "max_tokens"),
    (b'{"prompt": [1], "max_completion_tokens": 2}', 400, "max_completion_tokens"),
    (b'{"prompt": [1], "stream": true}', 400, "stream"),
    (b'{"prompt": [1], "echo": true}', 400, "echo"),
    (b'{"prompt": [1], "n": 2}', 400, "n"),
    (b'{"prompt": [1], "best_of": true}', 400, "best_of"),
    (b'{"prompt": [1], "logprobs": 6}', 400, "logprobs"),
    (b'{"prompt": [1], "logprobs": -1}', 400, "logprobs"),
    (b'{"prompt": [1], "kv_transfer_params": [1]}', 400, "kv_transfer_params"),
    (b'{"prompt": [1], "ttft_slo_ms": 0}', 400, "ttft_slo_ms"),
    (b'{"prompt": [1], "ttft_slo_ms": "100"}', 400, "ttft_slo_ms"),
    (b'{"prompt": [1], "ttft_slo_ms": 1e400}', 400, None),
    (b'{"prompt": [1], "request_id": "../escape"}', 400, "request_id"),
    (b'{"prompt": [1], "request_id": 17}', 400, "request_id"),
    (b'{"prompt": [1], "request_id": "taken"}', 400, "request_id"),                # duplicate id
    (b'{"prompt": [1], "model": "gpt-4"}', 404, "model"),
    (b'{"prompt": [1], "model": 7}', 400, "model"),
]


def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))


def test_every_rule_is_a_4xx_naming_the_field(tmp_path):
    tok, seen = _tokenizer(), {"taken"}
    limits = dict(model_name="tiny", vocab_size=VOCAB, max_tokens=100, tokenizer=tok, seen_ids=seen, top_k=TOP_K,
                  kv_store=KVStore(str(tmp_path)))
    for number, (body, status, param) in enumerate(MALFORMED, 1):
        with pytest.raises(http.HttpError) as e:
            http.validate(body, {}, number, **limits)
        assert (e.value.status, e.value.param) == (status, param), (body[:80], str(e.value))
        assert str(e.value).startswith(f"request {number}"), str(e.value)
        if param not in (None, "prompt", "request_id", "model"):
            assert f"'{param}'" in str(e.value), str(e.value)  # the message names the field too
    # valid forms: text (the boundary's tokenizer rule), ids, a one-prompt list; the id from X-Request-Id; the
    # decode-only sampling fields are accepted
    text = "It was the best <|endoftext|> of times"
    for body, headers, tokens, rid in [
            ({"prompt": text, "temperature": 0.7, "seed": 1}, {}, tok.encode(text).ids, None),
            ({"prompt": [[3, 4, 5]], "max_tokens": 1, "logprobs": 2}, {"X-Request-Id": "hdr-1"}, [3, 4, 5], "hdr-1"),
            ({"prompt": ["abc"], "request_id": "body-1", "ttft_slo_ms": 250}, {"X-Request-Id": "x"},
             tok.encode("abc").ids, "body-1")]:
        v = http.validate(json.dumps(body).encode(), headers, 99, **limits)
        assert v.request.tokens.tolist() == tokens and (rid is None or v.id == rid)
        assert json.loads(v.line) == {"id": v.id, "tokens": tokens, **({"ttft_slo_ms": 250.0} if rid == "body-1"
                                                                        else {})}
    assert tok.encode(text).ids.count(tok.token_to_id("<|endoftext|>")) == 1  # special tokens: the control token
    # text_literal, as in request lines: the special-token string is plain text (it was ignored over HTTP)
    v = http.validate(json.dumps({"prompt": text, "text_literal": True}).encode(), {}, 98, **limits)
    line = requests_lib.parse(json.dumps({"id": "x", "text": text, "text_literal": True}), 1, vocab_size=VOCAB,
                              max_tokens=100, tokenizer=tok)
    assert v.request.tokens.tolist() == line.tokens.tolist() != tok.encode(text).ids and v.ignored == []
    # fields the prefill does not read (sampling, structured outputs, prompt_logprobs, ...) are ignored, not refused
    extra = {"guided_json": {}, "structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"},
             "prompt_logprobs": 3, "min_tokens": 2, "seed": 7}
    v = http.validate(json.dumps({"prompt": [3, 4], **extra}).encode(), {}, 101, **limits)
    assert v.request.tokens.tolist() == [3, 4] and v.ignored == sorted(extra)
    # a chat body: the checkpoint's template rendered to text, tokenized like a text prompt; none: 400
    template = http.ChatTemplate("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
                                 "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}", {})
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "temperature": 0}
    v = http.validate(json.dumps(chat).encode(), {}, 102, chat=True, chat_template=template, **limits)
    text = "<|start|>user<|message|>Hi<|end|><|start|>user<|message|>a\nb<|end|><|start|>assistant"
    assert v.request.tokens.tolist() == tok.encode(text).ids and v.chat and v.ignored == ["temperature"]
    for body, param in [({**chat, "messages": []}, "messages"), ({**chat, "messages": [{"content": "x"}]}, "messages"),
                        ({**chat, "add_generation_prompt": 1}, "add_generation_prompt"),
                        ({**chat, "max_tokens": 5}, "max_tokens")]:
        with pytest.raises(http.HttpError) as e:
            http.validate(json.dumps(body).encode(), {}, 103, chat=True, chat_template=template, **limits)
        assert (e.value.status, e.value.param) == (400, param), str(e.value)
    with pytest.raises(http.HttpError) as e:
        http.validate(json.dumps(chat).encode(), {}, 104, chat=True, chat_template=None, **limits)
    assert e.value.param == "messages" and "has no chat template" in str(e.value)
    assert http.ChatTemplate.find(SHIPPED) is None  # the shipped checkpoints have none
    # an id whose export exists: 409
    (tmp_path / "exists").mkdir()
    with pytest.raises(http.HttpError) as e:
        http.validate(b'{"prompt": [1], "request_id": "exists"}', {}, 100, **limits)
    assert e.value.status == 409 and "already exists" in str(e.value)


def test_answer_logprobs_are_a_log_softmax_of_the_logits():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=VOCAB).astype(np.float32) * 3
    order = np.argsort(-logits)[:TOP_K]
    lse = np.log(np.exp(logits.astype(np.float64)).sum())
    first = int(order[0])
    record = {"id": "r", "line": 1, "first_token": first, "first_token_text": " x",
              "logprob": round(float(logits[first] - lse), 6),
              "top_k": [[int(t), round(float(logits[t]), 6)] for t in order], "num_tokens": 3, "ttft_ms": 5.0,
              "queue_ms": 1.0, "compute_ms": 4.0, "compile_ms": 0.0, "export_ms": 1.0, "predicted_ttft_ms": 4.5,
              "kv_path": "kv/r"}
    tok = _tokenizer()
    v = http.validate(b'{"prompt": [7, 8, 9], "logprobs": 3, "request_id": "r"}', {}, 1, model_name="m",
                      vocab_size=VOCAB, max_tokens=100, tokenizer=tok, seen_ids=set(), top_k=TOP_K,
                      kv_store=KVStore("kv"))
    status, body = http.completion_body(record, v, "m")
    assert status == 200
    top = body["choices"][0]["logprobs"]["top_logprobs"][0]
    assert list(top) == [str(t) for t in order[:3]]
    for t, lp in top.items():  # 6-decimal rounding of logits and logprob: 2e-6 (float64 reference)
        assert abs(lp - (logits[int(t)] - lse)) < 2e-6
    assert body["choices"][0]["token_ids"] == [first] and body["choices"][0]["text"] == " x"
    assert body["kv_transfer_params"] == {"slope_jax_kv_path": os.path.abspath("kv/r"), "slope_jax_first_token": first,
                                          "num_tokens": 3, "token_ids_sha256": kvfmt.token_hash(np.array([7, 8, 9]))}
    assert {k: body[k] for k in ("ttft_ms", "queue_ms", "compute_ms", "predicted_ttft_ms")} == {
        "ttft_ms": 5.0, "queue_ms": 1.0, "compute_ms": 4.0, "predicted_ttft_ms": 4.5}
    assert "prediction_note" not in body  # within 25 % of the prediction: the record has none either
    note = "TTFT 9 ms vs 4 ms predicted (+100%): mostly computing, 8 ms vs 4 ms predicted"
    _, body = http.completion_body({**record, "ttft_ms": 9.0, "prediction_note": note}, v, "m")
    assert body["prediction_note"] == note  # the answer says why, as the results record does
    status, body = http.completion_body({"id": "r", "line": 4, "error": "line 4 (r): rejected: predicted TTFT 9.0 "
                                         "ms exceeds the allowed 1.0 ms (ttft_slo_ms)", "rejected": True}, v, "m")
    assert status == 503 and body["error"]["message"].startswith("request (r): rejected: predicted TTFT")


# ---- the proxy, against stand-in prefill and decode servers ------------------------------------------------------
def _stand_ins(seen):
    """A stand-in prefill (`/v1/completions`, `/v1/chat/completions`, `/v1/kv/release`) and decode server recording
    what they get: the decode answers a prompt p with text "<p>!" (n choices), streamed in 3 events when asked;
    prompt "slow" keeps the decode busy 30 s (its cancellation is recorded)."""
    from aiohttp import web

    async def prefill(request):
        body = await request.json()
        seen["prefill"].append((body, request.headers["X-Request-Id"]))
        if body.get("prompt") == "bad":
            return web.json_response(http.error_body(400, "request 1: 'prompt' is bad", "prompt"), status=400)
        params = {"slope_jax_kv_path": f"/kv/{body['request_id']}", "slope_jax_first_token": 42, "num_tokens": 3,
                  "token_ids_sha256": "ab"}
        return web.json_response({"choices": [{"text": "a", "token_ids": [42]}], "kv_transfer_params": params,
                                  "ttft_ms": 12.5})

    async def release(request):
        seen["released"].append((await request.json())["request_id"])
        return web.json_response({"removed": True})

    async def decode(request):
        body = await request.json()
        seen["decode"].append((body, request.headers["X-Request-Id"]))
        if body.get("prompt") == "slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                seen["cancelled"].append(request.headers["X-Request-Id"])
                raise
        text = f"{body.get('prompt', 'chat')}!"
        n = body.get("n", 1)
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n,
                 "prompt_tokens_details": {"cached_tokens": 2}}
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-" + request.headers["X-Request-Id"], "choices": [
                {"index": j, "text": text} for j in range(n)], "usage": usage})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for piece in (text[:1], text[1:-1], text[-1:]):
            for j in range(n):
                await out.write(f"data: {json.dumps({'choices': [{'index': j, 'text': piece}]})}\n\n".encode())
            await asyncio.sleep(0.01)
        if (body.get("stream_options") or {}).get("include_usage"):
            await out.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out

    async def backend_health(request):
        return web.json_response({})

    apps = []
    for handlers in ({"/v1/completions": prefill, "/v1/chat/completions": prefill, "/v1/kv/release": release},
                     {"/v1/completions": decode, "/v1/chat/completions": decode}):
        a = web.Application()
        for path, handler in handlers.items():
            a.router.add_post(path, handler)
        a.router.add_get("/health", backend_health)
        apps.append(a)
    return apps


def _events(raw: str) -> list:
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


def test_proxy_flow_stream_and_errors():
    from aiohttp.test_utils import TestClient, TestServer

    seen = {"prefill": [], "decode": [], "released": [], "cancelled": []}

    async def main():
        backends = [TestServer(a, handler_cancellation=True) for a in _stand_ins(seen)]
        for server in backends:
            await server.start_server()
        proxy = TestClient(TestServer(pd_proxy.make_app(str(backends[0].make_url("")), str(backends[1].make_url("")),
                                                        release_grace_s=0.2), handler_cancellation=True))
        await proxy.start_server()
        try:
            await _check_one_prompt(proxy, seen)
            # the stand-in prefill publishes no NIXL record: the proxy (asking for NIXL) counts and warns
            assert proxy.server.app["fallbacks"]["files"] >= 1
            await _check_lists(proxy, seen)
            await _check_chat_and_disconnect(proxy, seen)
            r = await proxy.post("/v1/completions", json={"prompt": "bad", "max_tokens": 4})
            assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
            r = await proxy.post("/v1/completions", data=b"{not json")
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
            assert (await proxy.get("/health")).status == 200
            decode_url = str(backends[1].make_url("")).rstrip("/")
            await backends[1].close()
            health = await proxy.get("/health")
            assert health.status == 503 and decode_url in (await health.text())
            r = await proxy.post("/v1/completions", json={"prompt": "hi"})
            assert r.status == 502 and "decode server" in (await r.json())["error"]["message"]
            r = await proxy.get("/v1/models")  # what clients poll while vLLM starts: an answer, not a traceback
            assert r.status == 503 and "cannot be reached" in (await r.json())["error"]["message"]
        finally:
            await proxy.close()
            for b in backends:
                await b.close()

    asyncio.run(main())


async def _check_one_prompt(proxy, seen):
    request = {"prompt": "hi", "max_tokens": 16, "temperature": 0, "stream_options": {"x": 1}, "ttft_slo_ms": 500,
               "logprobs": 20, "n": 2, "echo": True, "prompt_logprobs": 1, "response_format": {"type": "json_object"},
               "structured_outputs": {"regex": "[a-z]+"}, "request_id": "body-id"}
    r = await proxy.post("/v1/completions", json=request, headers={"X-Request-Id": "trace/00-abc"})
    assert r.status == 200 and [c["text"] for c in (await r.json())["choices"]] == ["hi!", "hi!"]
    assert r.headers["X-Slope-Jax-First-Token"] == "42" and r.headers["X-Slope-Jax-TTFT-ms"] == "12.5"
    assert r.headers["X-Request-Id"] == "trace/00-abc"
    p_body, p_id = seen["prefill"][-1]
    export = p_body["request_id"]  # the client's id made a directory name, plus an attempt suffix
    assert export.startswith("trace_00-abc-") and len(export) == len("trace_00-abc-") + 12
    assert r.headers["X-Slope-Jax-Export"] == export
    # the prefill gets what it reads only; the decode server the client's body unchanged but for ttft_slo_ms
    assert p_body == {"prompt": "hi", "max_tokens": 1, "ttft_slo_ms": 500, "stream": False, "request_id": export,
                      "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    d_body, d_id = seen["decode"][-1]
    assert d_body == {**{k: v for k, v in request.items() if k != "ttft_slo_ms"},
                      "kv_transfer_params": {"slope_jax_kv_path": f"/kv/{export}", "slope_jax_first_token": 42,
                                             "num_tokens": 3, "token_ids_sha256": "ab"}}
    assert p_id == d_id == "trace/00-abc"
    await asyncio.sleep(0.05)
    assert seen["released"][-1] == export  # consumed: released at once
    # a retry with the same id: a new export, the same id on both sides
    r = await proxy.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "trace/00-abc"})
    assert r.status == 200 and seen["prefill"][-1][0]["request_id"] not in (export, None)
    assert seen["decode"][-1][1] == "trace/00-abc"
    # streamed: the decode server's events as they come; a new id, the same on both sides
    r = await proxy.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    assert "".join(e["choices"][0]["text"] for e in _events(await r.text())) == "hi!"
    assert seen["prefill"][-1][1] == seen["decode"][-1][1] == r.headers["X-Request-Id"]
    # a generated id is vLLM's own form: 32 hex digits, to which vLLM adds "cmpl-" in its answer's `id`
    assert len(r.headers["X-Request-Id"]) == 32 and int(r.headers["X-Request-Id"], 16) >= 0


async def _check_lists(proxy, seen):
    n_prefill = len(seen["prefill"])
    prompts = [[4], [5, 6], [7, 8]]  # token-id lists (a list mixing text and ids is refused, as vLLM refuses it)
    r = await proxy.post("/v1/completions", json={"prompt": prompts, "n": 2}, headers={"X-Request-Id": "L"})
    assert r.status == 200
    body = await r.json()
    # vLLM's list answer: index = prompt × n + choice, usage summed
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "[4]!"), (1, "[4]!"), (2, "[5, 6]!"), (3, "[5, 6]!"), (4, "[7, 8]!"), (5, "[7, 8]!")]
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 6}}
    prefills = seen["prefill"][n_prefill:]
    assert sorted(json.dumps(b["prompt"]) for b, _ in prefills) == sorted(json.dumps(p) for p in prompts)
    exports = {b["request_id"] for b, _ in prefills}
    assert len(exports) == 3 and r.headers["X-Slope-Jax-Export"].count(",") == 2  # one export per prompt
    decodes = {i: b for b, i in seen["decode"][-3:]}
    assert sorted(decodes) == ["L-0", "L-1", "L-2"]
    assert decodes["L-1"]["prompt"] == [5, 6] and decodes["L-1"]["kv_transfer_params"]["slope_jax_kv_path"] in {
        f"/kv/{e}" for e in exports}
    await asyncio.sleep(0.05)
    assert exports <= set(seen["released"])
    # streamed: each prompt's events with shifted indices, one summed usage chunk, one [DONE]
    r = await proxy.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    events = _events(await r.text())
    texts = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "ab!", 1: "ab!", 2: "cd!", 3: "cd!"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    # one prompt of a list refused: its error, and no decode at all
    n_decode = len(seen["decode"])
    r = await proxy.post("/v1/completions", json={"prompt": ["a", "bad"]})
    assert r.status == 400 and len(seen["decode"]) == n_decode


async def _check_chat_and_disconnect(proxy, seen):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "temperature": 0.5,
            "logprobs": True, "top_logprobs": 2, "add_generation_prompt": True}
    r = await proxy.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "chat-1"})
    assert r.status == 200
    p_body, _ = seen["prefill"][-1]
    assert p_body["messages"] == chat["messages"] and p_body["add_generation_prompt"] is True
    assert not {"temperature", "logprobs", "top_logprobs", "max_completion_tokens"} & set(p_body)
    d_body, d_id = seen["decode"][-1]
    assert d_id == "chat-1" and {k: d_body[k] for k in chat} == chat and "kv_transfer_params" in d_body
    # a client that leaves cancels its decode request; the export is released after the grace period
    task = asyncio.create_task(proxy.post("/v1/completions", json={"prompt": "slow"}, headers={"X-Request-Id": "S"}))
    while not seen["decode"] or seen["decode"][-1][1] != "S":
        await asyncio.sleep(0.02)
    export = seen["prefill"][-1][0]["request_id"]
    task.cancel()
    t = asyncio.get_running_loop().time()
    while "S" not in seen["cancelled"] or export not in seen["released"]:
        assert asyncio.get_running_loop().time() - t < 5, (seen["cancelled"], seen["released"][-3:])
        await asyncio.sleep(0.02)


# ---- the launcher serving HTTP on two processes ------------------------------------------------------------------
def _post(url, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("http")
    port, coord = free_port(), free_port()
    procs = []
    for i in (1, 0):
        cmd = [sys.executable, "-m", "slope_jax.launch", "--num_processes=2", f"--process_id={i}",
               f"--coordinator_address=127.0.0.1:{coord}", "--cpu_devices=1", "--ring=2", *COMMON,
               f"--http_port={port}", f"--kv_dir={base / 'kv'}", f"--results={base / 'results.jsonl'}",
               "--max_tokens=100", "--batch_wait_ms=200"]
        log = open(base / f"p{i}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=launcher_env(), stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                assert r.status == 200
                break
        except OSError:
            if time.time() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail((base / "p0.log").read_text()[-3000:])
            time.sleep(0.5)
    yield url, base, procs
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)


def test_endpoint_serves_first_token_and_export(server):
    import torch
    import transformers

    url, base, _ = server
    rng = np.random.default_rng(0)
    # lengths that cross the window and do not divide the mesh, in one compiled bucket (48) to keep the test cheap
    prompts = {"a": rng.integers(0, VOCAB, W + 5).tolist(), "b": rng.integers(0, VOCAB, W + 13).tolist()}
    answers = {}

    def ask(name):  # two requests in flight at once: each answer is routed to its own request
        answers[name] = _post(url + "/v1/completions", {"prompt": prompts[name], "max_tokens": 1, "logprobs": 2,
                                                        "request_id": f"req-{name}", "model": "tiny-gpt-oss"})

    threads = [threading.Thread(target=ask, args=(name,)) for name in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    model = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    for name, ids in prompts.items():
        status, body = answers[name]
        assert status == 200, body
        assert body["id"] == f"req-{name}" and body["usage"]["prompt_tokens"] == len(ids)
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # shorter than a prefix block
        params = body["kv_transfer_params"]
        assert set(params) == {"slope_jax_kv_path", "slope_jax_first_token", "num_tokens", "token_ids_sha256"}
        assert params["slope_jax_kv_path"] == str(base / "kv" / f"req-{name}")
        assert params["num_tokens"] == len(ids) and params["token_ids_sha256"] == kvfmt.token_hash(np.array(ids))
        first = body["choices"][0]["token_ids"][0]
        assert params["slope_jax_first_token"] == first
        manifest = kvfmt.read_manifest(params["slope_jax_kv_path"])  # the export is on disk and complete
        assert manifest["first_token"] == first and manifest["token_ids_sha256"] == params["token_ids_sha256"]
        assert kvfmt.load(params["slope_jax_kv_path"]).keys()
        for key in ("ttft_ms", "queue_ms", "compute_ms", "predicted_ttft_ms"):
            assert body[key] >= 0
        assert abs(body["ttft_ms"] - body["queue_ms"] - body["compute_ms"]) < 0.01  # TTFT = queue + compute
        with torch.no_grad():  # the independent reference: transformers' GptOss in float32
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        ref = torch.log_softmax(logits, -1)
        assert first == int(torch.argmax(logits))
        lp = body["choices"][0]["logprobs"]
        assert abs(lp["token_logprobs"][0] - float(ref[first])) < 1e-4  # float32 prefill vs float32 HF: 1e-4
        for t, v in lp["top_logprobs"][0].items():
            assert abs(v - float(ref[int(t)])) < 1e-4
    records = [json.loads(x) for x in (base / "results.jsonl").read_text().splitlines()]
    assert {r["id"] for r in records if "error" not in r} >= {"req-a", "req-b"}  # the results file logs them too


def test_endpoint_errors(server):
    url, base, _ = server
    status, body = _post(url + "/v1/completions", {"prompt": [1, 2, 99999], "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "prompt" and "outside the vocabulary [0, 1024)" in \
        body["error"]["message"]
    status, body = _post(url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 16})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = _post(url + "/v1/completions", b"{oops")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(url + "/v1/completions", {"prompt": [1], "model": "other"})
    assert status == 404 and body["error"]["param"] == "model"
    status, body = _post(url + "/v1/completions", {"prompt": [1, 2], "cache_salt": 7})
    assert status == 400 and body["error"]["param"] == "cache_salt" and "non-empty string" in body["error"]["message"]
    # SLO admission: a TTFT no prefill can meet is rejected at once, naming predicted vs allowed
    status, body = _post(url + "/v1/completions", {"prompt": [1, 2, 3], "ttft_slo_ms": 0.001, "request_id": "slo"})
    assert status == 503 and "rejected: predicted TTFT" in body["error"]["message"], body
    assert not os.path.exists(base / "kv" / "slo")
    # a text prompt (39 tokens: the bucket compiled above), then the same id again: 400 (ids name exports and are
    # unique in a run)
    text = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of " \
           "foolishness, it was the epoch of belief"
    status, body = _post(url + "/v1/completions", {"prompt": text, "request_id": "t"})
    ids = _tokenizer().encode(text).ids
    assert status == 200 and body["usage"]["prompt_tokens"] == len(ids) == 39
    assert body["kv_transfer_params"]["token_ids_sha256"] == kvfmt.token_hash(np.array(ids))
    status, body = _post(url + "/v1/completions", {"prompt": [4], "request_id": "t"})
    assert status == 400 and body["error"]["param"] == "request_id" and "duplicate id" in body["error"]["message"]
    # the id from the X-Request-Id header, whatever its case (urllib sends "X-request-id"; aiohttp hands the server
    # "X-Request-ID")
    status, body = _post(url + "/v1/completions", {"prompt": text}, headers={"X-Request-Id": "hdr-2"})
    assert status == 200 and body["id"] == "hdr-2" and os.path.isdir(base / "kv" / "hdr-2"), body
    with urllib.request.urlopen(url + "/v1/models") as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny-gpt-oss"]


def test_http_flag_errors(tmp_path):
    for args, message in [
            ([f"--requests={tmp_path}/x.jsonl", "--kv_dir=kv"], "--http_port and --requests are exclusive"),
            ([], "--http_port needs --kv_dir"),
            (["--kv_dir=kv", "--http_port=70000"], "--http_port=70000: must be in 0..65535"),
            (["--kv_dir=kv", "--kv_pool_gib=-1"], "--kv_pool_gib=-1.0: must be a finite number >= 0"),
            (["--kv_dir=kv", "--kv_lease_s=0"], "--kv_lease_s=0.0: must be a finite number of seconds > 0")]:
        r = subprocess.run([sys.executable, "-m", "slope_jax.launch", "--http_port=8100", *args], cwd=REPO,
                           env=launcher_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]


def test_huge_body_does_not_stall_others_and_release(server):
    """A ~6 MB text body (tokenized on the endpoint's validation threads, GIL released: ~5 s of tokenizer work here)
    is in flight while a small request is served: the small one's answer must not wait for it (< 2 s: it took 0.37 s
    here, its own prefill on 2 shared cores with the bucket compiled by the warm-up; tokenizing on the event loop, or
    holding the GIL while tokenizing, holds it for the rest of the tokenization: 3.5 s here, 14 s for 12 MB in the
    issue). Then the chat route without a chat template, and /v1/kv/release."""
    url, base, _ = server
    small = {"prompt": list(range(3, 3 + W + 5)), "max_tokens": 1}
    status, body = _post(url + "/v1/completions", {**small, "request_id": "warm"})  # compile the bucket first
    assert status == 200, body
    with open(os.path.join(REPO, "checkpoints", "corpus.txt")) as f:
        corpus = f.read()
    huge = (corpus * (1 + 6_000_000 // len(corpus)))[:6_000_000]
    big = {}

    def send_big():
        t = time.perf_counter()
        big["answer"] = _post(url + "/v1/completions", {"prompt": huge, "request_id": "huge"})
        big["s"] = time.perf_counter() - t

    thread = threading.Thread(target=send_big)
    thread.start()
    time.sleep(1.0)  # the big body is sent and being tokenized
    t = time.perf_counter()
    status, body = _post(url + "/v1/completions", {**small, "request_id": "small"})
    small_s = time.perf_counter() - t
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        assert r.status == 200
    thread.join()
    print(f"small request {small_s:.2f} s while a 6 MB body took {big['s']:.2f} s")
    assert status == 200, body
    assert "answer" in big and big["s"] > small_s  # the big one was really in flight meanwhile
    assert big["answer"][0] == 400 and "exceeds the limit of 100" in big["answer"][1]["error"]["message"]
    assert small_s < 2.0
    # chat: the shipped checkpoint has no chat template: a 400 that says so, naming `messages`
    status, body = _post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages" and "no chat template" in body["error"]["message"]
    # release: an export shorter than a prefix block (no reusable blocks) is removed; only answered ids
    assert os.path.isdir(base / "kv" / "small")
    status, body = _post(url + "/v1/kv/release", {"request_id": "small"})
    assert status == 200 and body["removed"] is True, body
    assert not os.path.lexists(base / "kv" / "small")
    status, body = _post(url + "/v1/kv/release", {"request_id": "small"})
    assert status == 404
    status, body = _post(url + "/v1/kv/release", {"request_id": "huge"})
    assert status == 404


def test_sigterm_prints_the_summary_of_what_was_served(server):
    """An endpoint runs until it is stopped: SIGTERM to every process (as launch/local.sh stops them; process 1
    first, so process 0 learns of its peer's end before its own signal) ends process 0 with the summary of the
    records written so far (its count line agrees with the results file) and status 2 (peer lost) or 143. Last in
    this file: it stops the module's server."""
    url, base, procs = server
    procs[0].send_signal(signal.SIGTERM)  # process 1 (started first)
    time.sleep(0.5)
    procs[1].send_signal(signal.SIGTERM)  # process 0
    assert procs[1].wait(timeout=60) in (2, 143)
    log = (base / "p0.log").read_text()
    records = (base / "results.jsonl").read_text().splitlines()
    assert f"{len(records)} records: " in log and "SLO attainment" in log and "(summary at " in log, log[-3000:]


def test_a_request_whose_client_left_is_cancelled_not_computed(tmp_path):
    """A client that disconnects before its prefill starts: waiting in the endpoint's queue (`HttpIntake.get`) or
    already in the scheduler (`Intake` cancels it there), its request is never batched and gets one record with
    `"cancelled": true`; the summary and SLO stats count it as cancelled, neither failed nor in attainment."""
    intake = http.HttpIntake("127.0.0.1", 0, model_name="tiny", vocab_size=VOCAB, max_tokens=100, tokenizer_path=None,
                             top_k=TOP_K, kv_store=KVStore(str(tmp_path)), kv_pool_gib=0)
    loop = asyncio.new_event_loop()
    futures = {}

    def arrive(rid):  # what `_completions` does with a validated request
        futures[rid] = loop.create_future()
        intake._waiters[rid] = (futures[rid], None)
        line = json.dumps({"id": rid, "tokens": [1, 2, 3], "ttft_slo_ms": 60_000}).encode()
        intake._queue.put((rid, line, time.perf_counter()))

    out = io.StringIO()
    front = Front(None, types.SimpleNamespace(ttft_slo_ms=None), types.SimpleNamespace(vocab_size=VOCAB), 100, None,
                  out, None, types.SimpleNamespace(refusal=lambda n: None))
    front.source = intake
    front.intake = Intake(intake, Scheduler(lambda lengths: 1.0, batch_size=8, batch_wait_ms=0), front.parse_line,
                          front.emit)
    for rid in ("a", "b", "c"):
        arrive(rid)
    intake._abandon("b", futures["b"])  # left while in the endpoint's queue
    front.intake._drain()  # a and c reach the scheduler; b is recorded at once
    intake._abandon("c", futures["c"])  # left while queued in the scheduler
    batch = front.intake.next_batch()
    assert [r.id for r in batch] == ["a"]
    records = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(r["id"], r.get("cancelled")) for r in records] == [("b", True), ("c", True)], records
    assert all("client disconnected" in r["error"] for r in records) and records[1]["num_tokens"] == 3
    assert intake.clients_left() == set()  # their records were delivered: nothing is left to reclaim
    served = {"id": "a", "num_tokens": 3, "cached_tokens": 0, "first_token": 7, "ttft_ms": 5.0, "queue_ms": 1.0,
              "compile_ms": 0.0, "compute_ms": 4.0, "export_ms": 0.0, "ttft_slo_ms": 60_000, "slo_met": True}
    text = summary.format_summary(records + [served], 1.0)
    assert "3 records: 1 ok (1 SLO met, 0 late), 0 rejected, 2 cancelled, 0 failed" in text, text
    st = slo_stats(records + [served], 1.0)
    assert (st.cancelled, st.failed, st.with_slo, st.attainment) == (2, 0, 1, 1.0)
    assert "cancelled 2, failed 0" in st.summary_line()
    loop.close()


def test_a_client_that_leaves_while_its_request_is_checked_gets_a_cancelled_record(tmp_path, monkeypatch):
    """A client that sends its whole body and disconnects at once leaves while `validate` (on the validation pool)
    reserves its id: the request still reaches the loop, as abandoned, so it gets its `"cancelled": true` record and
    is never computed (it took the id with no trace: a retry with that id was refused as a duplicate of a request
    that existed nowhere). An invalid body whose client left queues nothing."""
    from slope_jax.serve import requests as requests_lib

    intake = http.HttpIntake("127.0.0.1", 0, model_name="tiny", vocab_size=VOCAB, max_tokens=100, tokenizer_path=None,
                             top_k=TOP_K, kv_store=KVStore(str(tmp_path)), kv_pool_gib=0)
    real, started, go = http.validate, threading.Event(), threading.Event()

    def slow_validate(*args, **kwargs):
        started.set()
        go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(http, "validate", slow_validate)

    class Request:  # what aiohttp hands `_completions`
        def __init__(self, body):
            self.body, self.headers, self.app, self.content_length = body, {}, {"tokenizer": None}, None

        async def read(self):
            return json.dumps(self.body).encode()

    async def leave_while_checked(body):
        started.clear()
        go.clear()
        task = asyncio.ensure_future(intake._completions(Request(body), chat=False))
        assert await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        task.cancel()  # the client disconnected: aiohttp cancels the handler
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        for _ in range(200):  # the check finishes on its thread; its done callback runs on this loop
            await asyncio.sleep(0.01)
            if intake._pool._work_queue.empty() and not intake._queue.empty():
                break

    asyncio.run(leave_while_checked({"prompt": [1, 2, 3], "request_id": "gone"}))
    raw, _ = intake.get(5)
    assert isinstance(raw, requests_lib.ClientLeft) and raw.request_id == "gone"
    asyncio.run(leave_while_checked({"prompt": [], "request_id": "bad"}))  # invalid: 400 had the client stayed
    time.sleep(0.2)
    assert intake._queue.empty()
    intake._pool.shutdown()


def test_a_body_over_the_limit_gets_a_json_413_at_once():
    """A declared Content-Length over the 64 MiB limit is answered at once with OpenAI's error shape (the server
    waited for a body the client never sent); a body that turns out larger (aiohttp's own check while reading) gets
    the same JSON 413, not aiohttp's plain-text one."""
    from aiohttp import web

    class Declared:
        content_length = http.MAX_BODY_BYTES + 1

        async def read(self):
            await asyncio.sleep(3600)  # the body never comes

    class Oversized:
        content_length = None

        async def read(self):
            raise web.HTTPRequestEntityTooLarge(max_size=http.MAX_BODY_BYTES, actual_size=http.MAX_BODY_BYTES + 1)

    for request in (Declared(), Oversized()):
        answer = asyncio.run(asyncio.wait_for(http._read_body(request), 10))
        body = json.loads(answer.body)
        assert answer.status == 413 and body["error"]["code"] == 413, body
        assert "is larger than the limit of 64 MiB" in body["error"]["message"], body


def test_a_nixl_request_answered_by_files_says_why(tmp_path, monkeypatch):
    """A request that asks for the NIXL hand-off (a P/D proxy's do_remote_decode) but gets none carries the reason in
    its kv_transfer_params (`slope_jax_nixl_unavailable`), so the proxy's warning names it (it told the operator to
    check the NIXL install when the pool was only full): here the endpoint has no pool."""
    intake = http.HttpIntake("127.0.0.1", 0, model_name="tiny", vocab_size=VOCAB, max_tokens=100, tokenizer_path=None,
                             top_k=TOP_K, kv_store=KVStore(str(tmp_path)), kv_pool_gib=0)

    class Request:
        headers, app, content_length = {}, {"tokenizer": None}, None

        async def read(self):
            return json.dumps({"prompt": [1, 2, 3], "request_id": "r",
                               "kv_transfer_params": {"do_remote_decode": True}}).encode()

    def serve_one():  # the launcher's loop: take the line, answer it with a record
        raw, _ = intake.get(10)
        rid = json.loads(raw)["id"]
        intake.deliver({"id": rid, "first_token": 7, "num_tokens": 3, "kv_path": str(tmp_path / rid)})

    async def main():
        intake._loop = asyncio.get_running_loop()
        server = asyncio.get_running_loop().run_in_executor(None, serve_one)
        answer = await intake._completions(Request(), chat=False)
        await server
        return answer

    answer = asyncio.run(main())
    params = json.loads(answer.body)["kv_transfer_params"]
    assert params[http.NIXL_UNAVAILABLE] == "this prefill endpoint has no NIXL pool (its start-up log says why)"
    logged = []
    monkeypatch.setattr(pd_proxy.logging, "warning", lambda msg, *args: logged.append(msg % args))
    pd_proxy._note_files_fallback({"kv_transport": "nixl", "fallbacks": {"files": 0}}, params, "r")
    assert len(logged) == 1 and "it says: this prefill endpoint has no NIXL pool" in logged[0], logged
    intake._pool.shutdown()
