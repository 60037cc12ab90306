"""Shared fixtures: 8 virtual CPU devices, checkpoints of the two tiny configs of tests/support.py written in every
supported layout, and a single-device reference engine per config. Constants and helpers the test files import live
in tests/support.py.

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
import pytest  # noqa: E402

from slope_jax import compile_cache  # noqa: E402
from slope_jax.checkpoints import writer as checkpoint_writer  # noqa: E402
from support import CONFIGS, TILES  # noqa: E402  (the shared constants and helpers: tests/support.py)

jax.config.update("jax_default_matmul_precision", "highest")

# The persistent XLA compilation cache (per-user default dir, or SLOPE_JAX_COMPILE_CACHE=<dir>|off): test processes
# and the launcher / API subprocesses they spawn (which inherit the variable) load the programs earlier runs compiled.
os.environ[compile_cache.ENV] = compile_cache.enable() or "off"

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


# Longest files first (cold-cache seconds on 2 cores, measured with --durations on a fresh compilation cache,
# 2026-12-04, an AVX2-only 2-core EPYC: prefix_reuse 189, launcher 185, vllm_connector 136, vllm_failures_sync 122,
# pd_vllm 122, context_parallel 112, pd_transformers 94, pipeline 92, determinism 86, peer_rows 67, …): with
# `-n 2 --dist loadfile --no-loadscope-reorder` (pyproject addopts; without the last flag xdist would order files by
# test count) each worker takes the next whole file when it is free, so starting the long ones first keeps one long
# file from running alone at the end. Order only: every collected test still runs.
# test_pd_transformers.py comes well after test_launcher.py so that it starts once the launcher's 2-process run has
# compiled its programs: its 2-process worker then loads them (same layout, dtype, tiles) instead of compiling them
# at the same time.
LONG_FILES = ("test_prefix_reuse.py", "test_launcher.py", "test_vllm_connector.py", "test_vllm_failures_sync.py",
              "test_pd_vllm.py", "test_context_parallel.py", "test_pd_transformers.py", "test_pipeline.py",
              "test_determinism.py", "test_peer_rows.py", "test_vllm_last_window.py", "test_vllm_failures.py",
              "test_request_loop.py", "test_http_endpoint.py", "test_nixl_transport.py", "test_traffic.py",
              "test_flash_attention.py", "test_kv_export.py", "test_plan.py", "test_slo_launcher.py",
              "test_kv_dir_degrade.py", "test_expert_parallel.py", "test_seq_pipeline.py", "test_compile_cache.py",
              "test_device_benchmark.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: file order kept otherwise
