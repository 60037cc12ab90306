"""Test-only helpers shared by the test files, the harness scripts beside them (determinism.py) and conftest.py: the
repository paths, two tiny gpt-oss configs with pairwise-distinct sizes, prompt and comparison helpers, the
environment of a launcher subprocess, a free local port, and the malformed request lines of the request-boundary tests.

Import-light (numpy and `slope_jax.model.config`, no JAX): a harness child imports it before it sets its own XLA
flags. The pytest fixtures (checkpoints in every layout, reference engines) and the test process's XLA flags live in
conftest.py, which takes its constants from here.
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np

from slope_jax.model.config import FULL, SLIDING, ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints", "tiny-gpt-oss")

# Pairwise-distinct sizes inside each config: hidden, heads, kv heads, head_dim, experts, top-k, intermediate, vocab,
# window are all different numbers, so a transposed or mislabelled axis cannot go unnoticed.
CONFIG_A = ModelConfig(
    num_hidden_layers=4, num_experts=6, experts_per_token=2, vocab_size=448, hidden_size=64, intermediate_size=96,
    num_attention_heads=16, num_key_value_heads=4, head_dim=12, sliding_window=10,
    layer_types=(SLIDING, FULL) * 2, eos_token_ids=(3,), pad_token_id=1)
# 9 layers: an odd count, so pipeline stages get odd layer counts (5+4, 3+2+2+2, 2+1+…)
CONFIG_B = ModelConfig(
    num_hidden_layers=9, num_experts=5, experts_per_token=3, vocab_size=320, hidden_size=96, intermediate_size=64,
    num_attention_heads=8, num_key_value_heads=2, head_dim=20, sliding_window=7,
    layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(9)), eos_token_ids=(5,), pad_token_id=2)
CONFIGS = {"A": CONFIG_A, "B": CONFIG_B}
TILES = dict(q_tile=8, kv_tile=8, prefix_q_tile=16, prefix_kv_tile=24, moe_tile=8)  # small tiles: every path (prefix
# hits: the attention over cached keys has its own tiles) crosses tile boundaries


def _sizes_distinct(c: ModelConfig) -> bool:
    v = [c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.num_experts, c.experts_per_token,
         c.intermediate_size, c.vocab_size, c.sliding_window]
    return len(set(v)) == len(v)


assert all(_sizes_distinct(c) for c in CONFIGS.values())


def random_prompt(cfg: ModelConfig, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32)


def assert_prefill_close(expected, got, tol: float) -> None:
    """Two lists of PrefillResult agree: same first token, logits and every layer's K/V within `tol` (max abs)."""
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert np.abs(a.logits - b.logits).max() < tol
        assert a.first_token == b.first_token
        for layer in a.kv:
            assert np.abs(a.kv[layer].k - b.kv[layer].k).max() < tol
            assert np.abs(a.kv[layer].v - b.kv[layer].v).max() < tol


def launcher_env() -> dict:
    """Environment for a launcher subprocess: it sets the device count and platform itself from its flags."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it; the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Malformed request lines (raw bytes) for the request-boundary tests: every kind of failure while reading, decoding,
# parsing, tokenizing or validating a line. Each must become exactly one error record; `MAX_TOKENS` is the
# --max_tokens the launcher tests use (the last lines exceed it).
MAX_TOKENS = 100


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


MALFORMED: list[bytes] = [
    b'{"id": "f-int64", "tokens": [1, 2, 18446744073709551616]}',          # beyond int64
    b'{"id": "f-neg-big", "tokens": [-99999999999999999999999]}',
    b'{"id": "f-surrogate", "text": "x \\ud800 y"}',                       # lone surrogate
    b'{"id": "f-surrogate2", "text": "\\udfff"}',
    b'\xff\xfe{"id": "f-latin1"}',                                         # not UTF-8
    b'{"id": "f-bad-utf8", "text": "caf\xe9"}',
    b'\xc3\x28',
    b'{"id": "f-float", "tokens": [1, 2.5]}',                              # wrong token types
    b'{"id": "f-float-int", "tokens": [1.0]}',
    b'{"id": "f-bool", "tokens": [true, false]}',
    b'{"id": "f-nested", "tokens": [[1, 2], [3]]}',
    b'{"id": "f-str-tok", "tokens": ["1", "2"]}',
    b'{"id": "f-null-tok", "tokens": [null]}',
    b'{"id": "f-tokens-str", "tokens": "1 2 3"}',
    b'{"id": "f-tokens-obj", "tokens": {"0": 1}}',
    b'{"id": "f-empty", "tokens": []}',
    b'{"id": "f-oov", "tokens": [1, 1024]}',
    b'{"id": "f-negative", "tokens": [-1]}',
    b'{"id": "f-slo-huge", "tokens": [1], "ttft_slo_ms": 1e400}',          # overflows a float
    b'{"id": "f-slo-nan", "tokens": [1], "ttft_slo_ms": NaN}',             # NaN / Infinity literals
    b'{"id": "f-slo-inf", "tokens": [1], "ttft_slo_ms": Infinity}',
    b'{"id": "f-slo-neginf", "tokens": [1], "ttft_slo_ms": -Infinity}',
    b'{"id": "f-slo-zero", "tokens": [1], "ttft_slo_ms": 0}',
    b'{"id": "f-slo-str", "tokens": [1], "ttft_slo_ms": "100"}',
    b'{"id": "f-slo-bool", "tokens": [1], "ttft_slo_ms": true}',
    b'NaN',
    b'[1, 2, 3]',                                                          # not an object
    b'"just a string"',
    b'42',
    b'null',
    b'{"id": "f-trunc", "tokens": [1, 2',                                  # not JSON
    b'{id: "f-unquoted"}',
    b'{"tokens": [1, 2]}',                                                 # id problems
    b'{"id": 17, "tokens": [1]}',
    b'{"id": null, "tokens": [1]}',
    b'{"id": "../escape", "tokens": [1]}',
    b'{"id": ".hidden", "tokens": [1]}',
    b'{"id": "' + b"x" * 200 + b'", "tokens": [1]}',
    b'{"id": "f-both", "tokens": [1], "text": "hi"}',                      # field problems
    b'{"id": "f-neither"}',
    b'{"id": "f-unknown", "tokens": [1], "temperature": 0.7}',
    b'{"id": "f-text-num", "text": 5}',
    b'{"id": "f-text-empty", "text": ""}',
    b'{"id": "f-literal-str", "text": "hi", "text_literal": "yes"}',
    b'{"id": "f-literal-tokens", "tokens": [1], "text_literal": true}',
    b'[' * 100000 + b']' * 100000,                                         # nesting deeper than the parser allows
    _j({"id": "f-too-long", "tokens": [5] * (MAX_TOKENS + 1)}),            # too long for --max_tokens
    b'{"id": "dup-target", "tokens": [9, 8, 7]}',                          # a valid line ...
    b'{"id": "dup-target", "tokens": [1, 2]}',                             # ... and its duplicate
]
# (the 48th line, dup-target, is valid: one result; every other line is one error record)
VALID_IN_MALFORMED = {"dup-target"}
