"""The persistent compilation cache (`slope_jax.compile_cache`): a program is loaded from the cache only under the
exact options that shaped it — changing the dtype, a tile size, the layout or a model constant that leaves every
shape as it was (the sliding window) is a miss and a freshly compiled program, never a stale one — and a hit gives
bit-identical results to the compiled program it replaces. Each test points the cache at its own empty directory."""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import CONFIG_A, TILES, random_prompt

from slope_jax.model.config import FULL, SLIDING

from slope_jax import compile_cache
from slope_jax.checkpoints import writer
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine


@pytest.fixture
def fresh_cache(tmp_path):
    previous = compile_cache.directory()
    directory = compile_cache.enable(str(tmp_path / "xla"))
    yield directory
    compile_cache.enable(previous or "off")


def _first(cfg, params, prompt, parallel=ParallelConfig(), dtype="float32", **tiles):
    """(where the program came from, logits, first layer's K) of a fresh engine's prefill of `prompt`."""
    engine = PrefillEngine(cfg, params, parallel, dtype, devices=jax.devices()[:parallel.num_devices],
                           **{**TILES, **tiles})
    r = engine.prefill([prompt], return_kv=True)[0]
    (source,) = engine.compile_source.values()
    return source, r.logits, np.asarray(r.kv[0].k, np.float32)


# CONFIG_A cut to one sliding and one full layer: every fault class below, at half the compile time
CFG = dataclasses.replace(CONFIG_A, num_hidden_layers=2, layer_types=(SLIDING, FULL))


def test_shaping_option_changed_is_a_miss_and_a_hit_is_bit_identical(fresh_cache):
    params = writer.random_params(CFG, seed=3)
    prompt = random_prompt(CFG, 13, seed=5)  # crosses the window (10), does not divide the 2-device mesh's 4
    source, logits, k = _first(CFG, params, prompt)
    assert source == "compiled"
    again = _first(CFG, params, prompt)
    assert again[0] == "cache"
    np.testing.assert_array_equal(again[1], logits)  # the cached program is the same program: bitwise
    np.testing.assert_array_equal(again[2], k)
    # each option below shapes the program; a stale hit would return the base program's (different) numbers
    window = dataclasses.replace(CFG, sliding_window=CFG.sliding_window - 3)  # same shapes, other mask
    variants = {"dtype": _first(CFG, params, prompt, dtype="bfloat16"),
                "tiles": _first(CFG, params, prompt, q_tile=4),
                "layout": _first(CFG, params, prompt, parallel=ParallelConfig(ring=2)),
                "model constant": _first(window, params, prompt)}
    for name, (source, v_logits, _) in variants.items():
        assert source == "compiled", name
    # the sliding window changes the numbers (so a stale hit would have shown); a tile size or layout must not
    assert np.abs(variants["model constant"][1] - logits).max() > 1e-3
    for name in ("tiles", "layout"):
        assert np.abs(variants[name][1] - logits).max() < 1e-4, name  # float32: op order only (tolerance 1e-4)
    assert _first(window, params, prompt)[0] == "cache"


def test_off_turns_jax_cache_off(fresh_cache):
    assert jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir == fresh_cache
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # every program is cached
    compile_cache.enable("off")
    assert compile_cache.directory() is None and not jax.config.jax_enable_compilation_cache


def test_directory_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "from-env"))
    assert compile_cache.resolve() == str(tmp_path / "from-env")
    assert compile_cache.resolve(str(tmp_path / "flag")) == str(tmp_path / "flag")  # the flag wins
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve() is None
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_dir() == str(tmp_path / "xdg" / "slope_jax" / "xla")
