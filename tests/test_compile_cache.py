"""The persistent compilation cache (`slope_jax.compile_cache`): a program is loaded from the cache only under the
exact options that shaped it — changing the dtype, a tile size, the layout or a model constant that leaves every
shape as it was (the sliding window) is a miss and a freshly compiled program, never a stale one — and a hit gives
bit-identical results to the compiled program it replaces. Each test points the cache at its own empty directory."""

import dataclasses
import os
import threading
import time

import jax
import numpy as np
import pytest
from support import CONFIG_A, TILES, random_prompt

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
    for name, (source, _, _) in variants.items():
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


def test_entries_are_written_whole_and_the_directory_is_trimmed_by_last_use(fresh_cache, tmp_path):
    """JAX's programs go through `DirectoryCache` (no lock file, no per-write directory scan); concurrent writers and
    readers of one key only ever see a whole entry; `trim` deletes least recently used entries down to
    MAX_BYTES · TRIM_TO, keeps recently read ones, and clears a killed writer's stale temporary files."""
    from jax._src import compilation_cache as jcc  # the object JAX writes through: only to check which class it is

    jax.jit(lambda x: x * 3 + 1)(np.arange(7.0)).block_until_ready()  # any program: JAX builds its cache now
    assert isinstance(jcc._cache, compile_cache.DirectoryCache)
    names = os.listdir(fresh_cache)
    assert names and all(n.endswith(compile_cache.SUFFIX) for n in names), names  # no lock, no -atime, no temp

    cache = compile_cache.DirectoryCache(str(tmp_path / "c"))
    values = [bytes([i]) * (1 << 20) for i in range(6)]  # 1 MiB each: a torn write would show as a mixed value
    seen, stop = set(), threading.Event()

    def read():
        while not stop.is_set():
            v = cache.get("k")
            if v is not None:
                seen.add((len(v), v[:1], v[-1:]))  # a torn read: shorter, or mixed bytes

    def write(v):
        for _ in range(20):
            cache.put("k", v)
            cache.clear()

    readers = [threading.Thread(target=read) for _ in range(2)]
    writers = [threading.Thread(target=write, args=(v,)) for v in values]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert seen and all(n == 1 << 20 and first == last for n, first, last in seen), seen
    assert not [n for n in os.listdir(tmp_path / "c") if n.endswith(".tmp")]

    trim_dir = tmp_path / "t"
    trim_dir.mkdir()
    now = time.time()
    for i in range(10):  # entry i last used i hours ago, 100 bytes each
        path = trim_dir / f"e{i}{compile_cache.SUFFIX}"
        path.write_bytes(b"x" * 100)
        os.utime(path, (now - 3600 * i, now - 3600 * i))
    assert compile_cache.DirectoryCache(str(trim_dir)).get("e9") is not None  # read now: the most recent
    for name, age in ((".old.1.2.tmp", 7200), (".new.1.2.tmp", 10)):
        (trim_dir / name).write_bytes(b"t")
        os.utime(trim_dir / name, (now - age, now - age))
    assert compile_cache.trim(str(trim_dir), max_bytes=1000) == 0  # 1000 bytes: at the cap, nothing to do
    assert compile_cache.trim(str(trim_dir), max_bytes=500) == 600  # down to 500 · 0.8 = 400 bytes
    kept = sorted(n for n in os.listdir(trim_dir) if n.endswith(compile_cache.SUFFIX))
    assert kept == [f"e{i}{compile_cache.SUFFIX}" for i in (0, 1, 2, 9)]  # the 3 newest and the one just read
    assert (trim_dir / ".new.1.2.tmp").exists() and not (trim_dir / ".old.1.2.tmp").exists()


def _record_many(directory, identity, start, count):
    for i in range(start, start + count):
        compile_cache.record_steps(identity, [(32 * (i + 1), 1)], directory)


def test_step_index_keeps_every_concurrent_writers_keys_and_trim_forgets_old_ones(tmp_path):
    """Four processes record 25 step keys each into one index at once: all 100 are there (merge under the lock,
    atomic replace); keys are per program identity; `trim` drops the keys recorded before what it deleted."""
    import multiprocessing

    directory = str(tmp_path / "xla")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(directory, "prog-a" if w < 3 else "prog-b", 25 * w, 25))
             for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    a, b = compile_cache.compiled_steps("prog-a", directory), compile_cache.compiled_steps("prog-b", directory)
    assert a == {f"{32 * (i + 1)},1" for i in range(75)} and b == {f"{32 * (i + 1)},1" for i in range(75, 100)}
    assert compile_cache.compiled_steps("prog-c", directory) == set()
    compile_cache.record_steps("prog-a", [(48, 2, 128)], directory)
    assert "48,2,128" in compile_cache.compiled_steps("prog-a", directory)
    # an entry last used after every key was recorded is trimmed: the index forgets them all
    time.sleep(0.05)
    entry = os.path.join(directory, "k1" + compile_cache.SUFFIX)
    with open(entry, "wb") as f:
        f.write(b"x" * 4096)
    with open(os.path.join(directory, "k2" + compile_cache.SUFFIX), "wb") as f:
        f.write(b"y" * 4096)
    os.utime(entry, (time.time() + 5, time.time() + 5))
    assert compile_cache.trim(directory, max_bytes=5000) > 0
    assert compile_cache.compiled_steps("prog-a", directory) == set()


class _Engine:
    """What BatchModel and slo.program_identity read of a PrefillEngine."""

    mesh = None
    parallel = ParallelConfig()
    options = "opts"

    def __init__(self, dtype="float32"):
        self.cfg, self.dtype = CONFIG_A, dtype
        self.params = {"w": np.zeros((4, 8), np.float32)}
        self.compile_ms, self.compile_source = {}, {}

    @staticmethod
    def bucket(n):
        return 32 * -(-n // 32)


def test_compile_estimate_is_per_shape(fresh_cache):
    """A run whose cache holds another shape's program still expects a full compile for a new shape (before: any
    older entry made every shape 'warm'); a shape an earlier run compiled is expected as a cache load."""
    from slope_jax.serve import slo

    first = _Engine()
    model = slo.BatchModel(first, lambda t, m: float(t), compile_prior_ms=8000.0)
    assert model.identity and model.compile_ms((64, 1)) == 8000.0  # cold cache: the prior
    first.compile_ms[(64, 1)], first.compile_source[(64, 1)] = 7400.0, "compiled"
    model.observe([50], 64.0)  # a finished batch: its step goes into the index
    assert model.compile_ms((64, 1)) == 0.0 and model.compile_ms((96, 1)) == 7400.0
    second = _Engine()  # the next run: same program identity, fresh process state
    model = slo.BatchModel(second, lambda t, m: float(t), compile_prior_ms=8000.0)
    assert model.compile_ms((64, 1)) == pytest.approx(8000.0 * slo.CACHE_HIT_FRACTION)  # listed: a load
    assert model.compile_ms((96, 1)) == 8000.0  # never compiled: a full compile, whatever else is cached
    second.compile_ms[(128, 1)], second.compile_source[(128, 1)] = 6100.0, "compiled"
    second.compile_ms[(64, 1)], second.compile_source[(64, 1)] = 900.0, "cache"
    assert model.compile_ms((96, 1)) == 6100.0  # the latest full compile, not the later load
    assert model.compile_ms((160, 1)) == 6100.0
    other = _Engine(dtype="bfloat16")  # another dtype is another program: nothing of it is cached
    assert slo.BatchModel(other, lambda t, m: float(t), compile_prior_ms=8000.0).compile_ms((64, 1)) == 8000.0
    # a prefix hit's program ((bucket, cached rows), prompts): a plain one's estimate x HIT_COMPILE_FACTOR until a
    # hit program is measured here, then that one (and a plain shape then comes from the latest plain compile)
    f = slo.HIT_COMPILE_FACTOR
    assert slo.BatchModel(other, lambda t, m: float(t), compile_prior_ms=8000.0).compile_ms(((64, 512), 1)) == \
        pytest.approx(8000.0 * f)
    assert model.compile_ms(((64, 512), 1)) == pytest.approx(6100.0 * f)
    second.compile_ms[(32, 1, 512)], second.compile_source[(32, 1, 512)] = 9900.0, "compiled"
    assert model.compile_ms(((64, 512), 1)) == 9900.0 and model.compile_ms((160, 1)) == 6100.0
    assert model.compile_ms(((32, 512), 1)) == 0.0
    assert compile_cache.compiled_steps(model.identity) == {"64,1", "128,1", "32,1,512"}
