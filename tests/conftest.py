"""Shared fixtures: 8 virtual CPU devices, two tiny gpt-oss configs with pairwise-distinct sizes, checkpoints written
in every supported layout, and a single-device reference engine per config.

The XLA flag must be set before jax is imported anywhere, hence at the top of conftest.
"""

import os

# 8 virtual CPU devices; in-process test programs compile for a short run: XLA's LLVM backend at -O0 (the same HLO
# after the same HLO passes, ~22 % less compile time measured on the CP parity tests) and XLA:CPU's elemental
# emitters instead of the MLIR fusion emitters (a float32 CP step: 1.5 s instead of 5.1 s at -O0; a cold suite took
# 463 s with them, 476–621 s without). Compiling is the suite's largest cost, and its prompts are short. Not the
# product's flags: the elemental emitters run an 8K-token prefill 1.5x slower (`slope_jax/xla_env.py`). Launcher
# subprocesses (`launcher_env`, the 2-process P/D workers) drop these and compile as users run them;
# tests/test_launcher.py compares their output with an in-process engine (within 1e-5).
TEST_XLA_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                  "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from slope_jax import compile_cache  # noqa: E402
from slope_jax.checkpoints import writer as checkpoint_writer  # noqa: E402
from slope_jax.model.config import FULL, SLIDING, ModelConfig  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The persistent XLA compilation cache (per-user default dir, or SLOPE_JAX_COMPILE_CACHE=<dir>|off): test processes
# and the launcher / API subprocesses they spawn (which inherit the variable) load the programs earlier runs compiled.
os.environ[compile_cache.ENV] = compile_cache.enable() or "off"

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
TILES = dict(q_tile=8, kv_tile=8, moe_tile=8)  # small tiles: every path crosses tile boundaries


def _sizes_distinct(c: ModelConfig) -> bool:
    v = [c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.num_experts, c.experts_per_token,
         c.intermediate_size, c.vocab_size, c.sliding_window]
    return len(set(v)) == len(v)


assert all(_sizes_distinct(c) for c in CONFIGS.values())


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{config name: {"mxfp4": dir (3 shards + index, original/ beside), "dense": dir}} written once per session."""
    out = {}
    for name, cfg in CONFIGS.items():
        params = checkpoint_writer.random_params(cfg, seed=7 + len(name) + ord(name))
        base = tmp_path_factory.mktemp(f"ckpt_{name}")
        mx, dense = str(base / "mxfp4"), str(base / "dense")
        checkpoint_writer.write_hf(mx, cfg, params, experts="mxfp4", num_shards=3)
        checkpoint_writer.write_original(os.path.join(mx, "original"), cfg, params)
        checkpoint_writer.write_hf(dense, cfg, params, experts="dense")
        out[name] = {"mxfp4": mx, "dense": dense, "params": params}
    return out


@pytest.fixture(scope="session")
def reference_engines(checkpoints):
    """Single-device float32 engines (the reference path) per config, from the MXFP4 checkpoint."""
    from slope_jax.serve.engine import PrefillEngine

    return {name: PrefillEngine.from_checkpoint(c["mxfp4"], dtype="float32", progress=False, **TILES)
            for name, c in checkpoints.items()}


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


# Longest files first (cold-cache seconds on 2 cores, measured): with `-n 2 --dist loadfile --no-loadscope-reorder`
# (pyproject addopts; without the last flag xdist would order files by test count) each
# worker takes the next whole file when it is free, so starting the long ones first keeps one long file from running
# alone at the end. Order only: every collected test still runs.
# test_pd_transformers.py comes after test_context_parallel.py so that it starts once test_launcher.py has finished
# (measured: launcher ~130 s, CP ~115 s after pd_vllm's ~55 s): its 2-process worker then loads the programs the
# launcher's 2-process run compiled (same layout, dtype, tiles) instead of compiling them at the same time.
LONG_FILES = ("test_determinism.py", "test_vllm_connector.py", "test_pd_vllm.py", "test_launcher.py",
              "test_context_parallel.py", "test_pd_transformers.py", "test_pipeline.py", "test_flash_attention.py",
              "test_traffic.py", "test_device_benchmark.py", "test_request_loop.py", "test_plan.py",
              "test_compile_cache.py", "test_expert_parallel.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: file order kept otherwise
