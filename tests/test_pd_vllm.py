"""End to end over HTTP on the CPU: client → P/D proxy → slope_jax prefill endpoint (2 processes × 4 devices) →
`vllm serve` decoding from the export through SlopeJaxConnector, all started by launch/pd_vllm.sh. vLLM's greedy
text (float32) must equal the same server's own run of the prompt without an export, vLLM must report n−1 prompt
tokens loaded from outside, its first token must equal the prefill's, streaming must give the same text, and a
malformed request must get the prefill's 4xx naming the field. One vLLM engine for the module; vLLM runs from its
own venv (`SLOPE_VLLM_PYTHON`, default `.venv-vllm/bin/python` as `.ci/run` creates it)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from support import REPO, launcher_env

CKPT = os.path.join(REPO, "checkpoints", "tiny-gpt-oss-hd64")
MODEL = "tiny-gpt-oss-hd64"
VLLM_PYTHON = os.environ.get("SLOPE_VLLM_PYTHON", os.path.join(REPO, ".venv-vllm", "bin", "python"))
with open(os.path.join(CKPT, "config.json")) as _f:
    _CONFIG = json.load(_f)
W, VOCAB = _CONFIG["sliding_window"], _CONFIG["vocab_size"]
LOGPROB_TOL = 1e-4  # |Δ logprob| of each greedy token, P/D vs vLLM alone (both float32)
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body, stream=False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            raw = r.read().decode()
            return r.status, dict(r.headers), raw if stream else json.loads(raw)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON}: create it as .ci/run does, or set SLOPE_VLLM_PYTHON")
    base = tmp_path_factory.mktemp("pd_vllm")
    ports = {name: _free_port() for name in ("PREFILL_PORT", "DECODE_PORT", "PROXY_PORT", "PORT")}
    env = {**launcher_env(), **{k: str(v) for k, v in ports.items()}, "PYTHON": sys.executable,
           "VLLM_PYTHON": VLLM_PYTHON, "KV_DIR": str(base / "kv"), "LOG_DIR": str(base), "READY_TIMEOUT": "1500",
           "VLLM_FLAGS": "--max-model-len=2048 --enforce-eager"}
    proc = subprocess.Popen(["bash", os.path.join(REPO, "launch", "pd_vllm.sh"), CKPT], cwd=REPO, env=env,
                            stdout=open(base / "pd_vllm.out", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    proxy = f"http://127.0.0.1:{ports['PROXY_PORT']}"
    while "ready" not in (base / "pd_vllm.out").read_text():
        if proc.poll() is not None:
            pytest.fail("launch/pd_vllm.sh stopped before it was ready:\n" + (base / "pd_vllm.out").read_text()
                        + "".join(f"\n--- {n}\n" + (base / n).read_text()[-3000:] for n in
                                  ("prefill.log", "decode.log", "proxy.log") if (base / n).exists()))
        time.sleep(1)
    yield proxy, f"http://127.0.0.1:{ports['DECODE_PORT']}", base
    proc.send_signal(signal.SIGTERM)  # the script stops all three servers on its way out
    proc.wait(timeout=120)
    for name in ("PREFILL_PORT", "DECODE_PORT", "PROXY_PORT"):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", ports[name])) != 0, f"{name} still served after the script stopped"


def test_pd_over_http_equals_vllm_alone(servers):
    proxy, decode, base = servers
    # token ids below the special tokens (the last ten of the vocabulary), W + 1 of them: crossing the window
    prompts = {"text": TEXT, "ids": np.random.default_rng(5).integers(0, VOCAB - 10, W + 1).tolist()}
    request = {"model": MODEL, "max_tokens": 16, "temperature": 0, "logprobs": 1, "return_token_ids": True}
    # vLLM alone first: no export of these prompts exists yet, and prefix caching is off (pd_vllm.sh)
    alone = {}
    for name, prompt in prompts.items():
        status, _, body = _post(decode + "/v1/completions", {**request, "prompt": prompt})
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        alone[name] = body
    for name, prompt in prompts.items():
        status, headers, body = _post(proxy + "/v1/completions", {**request, "prompt": prompt})
        assert status == 200, body
        n = body["usage"]["prompt_tokens"]
        assert n == alone[name]["usage"]["prompt_tokens"] and n > 1
        got, ref = body["choices"][0], alone[name]["choices"][0]
        assert got["text"] == ref["text"] and got["token_ids"] == ref["token_ids"]
        assert len(got["token_ids"]) == 16
        delta = np.abs(np.array(got["logprobs"]["token_logprobs"]) - np.array(ref["logprobs"]["token_logprobs"]))
        print(f"{name}: {n} tokens, max |Δ logprob| {delta.max():.2e}, prefill TTFT {headers['X-Slope-Jax-TTFT-ms']}"
              " ms")
        assert delta.max() <= LOGPROB_TOL
        assert int(headers["X-Slope-Jax-First-Token"]) == got["token_ids"][0]  # vLLM re-derives the prefill's token
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1  # n − 1 tokens came from the export
        assert body["kv_transfer_params"]["slope_jax_loaded_tokens"] == n - 1, body["kv_transfer_params"]
        # streamed: the same text, as server-sent events through the proxy
        status, headers, raw = _post(proxy + "/v1/completions", {**request, "prompt": prompt, "stream": True},
                                     stream=True)
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == ref["text"]
    # every prefill went through slope_jax: one result record per P/D request, each with its export
    records = [json.loads(x) for x in (base / "prefill_results.jsonl").read_text().splitlines()]
    assert len([r for r in records if "error" not in r]) == 2 * len(prompts)
    assert all(os.path.isdir(r["kv_path"]) for r in records)


def test_malformed_request_gets_the_prefill_4xx(servers):
    proxy, _, _ = servers
    status, _, body = _post(proxy + "/v1/completions", {"model": MODEL, "prompt": [1, 2, VOCAB], "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert f"token id {VOCAB} at index 2 is outside the vocabulary [0, {VOCAB})" in body["error"]["message"]
    status, _, body = _post(proxy + "/v1/completions", {"model": MODEL, "prompt": TEXT, "ttft_slo_ms": -1})
    assert status == 400 and body["error"]["param"] == "ttft_slo_ms"
