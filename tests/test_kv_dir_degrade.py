"""A `kv_dir` that takes no writes (issue 30 point 9): read-only, full, over quota, or a path whose parent cannot be
created. The prefill still answers (the cold prompt's first token), the exports already there still serve prefix
hits, the request's own export is reported as not written (`PrefillResult.export_error`, or a RequestError where the
store requires exports), nothing half-written stays behind, retention does not fail, the host tier keeps working, and
the condition is logged once per store, not once per request.

Root (the usual test user here) ignores `chmod`, so a read-only directory is simulated: every write call under it
fails with EROFS, and a full disk or quota raises ENOSPC / EDQUOT at the export's commit points
(`kv.format._crash_point`), after real files were written. A path under a regular file (ENOTDIR) and, for other
users, `chmod 0555` are real kernel errors.
"""

import errno
import logging
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from support import CONFIG_A, REPO, TILES, random_prompt

from slope_jax import kv
from slope_jax.kv import format as kvfmt
from slope_jax.kv import prefix as prefix_lib
from slope_jax.kv.store import KVStore
from slope_jax.serve.engine import PrefillEngine
from slope_jax.serve.requests import RequestError

BLOCK = 8
TOL = 2e-5  # float32 logits of a hit vs the cold prompt (as tests/test_prefix_reuse.py)
DOC = random_prompt(CONFIG_A, 40, seed=5)
MEANING = "prefix reuse continues from the exports already there without storing new prefixes"


def _engine(checkpoints, **reuse):
    return PrefillEngine.from_checkpoint(checkpoints["A"]["mxfp4"], dtype="float32", progress=False,
                                         reuse=prefix_lib.ReuseOptions(block_size=BLOCK, **reuse), **TILES)


def _turn(n: int, seed: int) -> np.ndarray:
    """DOC (5 cached blocks), then n − 40 other tokens."""
    return np.concatenate([DOC, random_prompt(CONFIG_A, n - DOC.size, seed=seed)]).astype(np.int32)


@pytest.fixture(scope="module")
def engines(checkpoints):
    """(writer, reader): engines without a host tier, so every hit comes from the kv_dir; the reader builds each
    directory's index from the manifests on disk, as after a restart."""
    return _engine(checkpoints, host_bytes=0), _engine(checkpoints, host_bytes=0)


@pytest.fixture
def populated(engines, tmp_path):
    d = str(tmp_path / "kv")
    engines[0].prefill([DOC], d, ids=["doc"])
    return d


def _read_only(monkeypatch, d: str) -> None:
    """Every write call under `d` (create, rename, link, remove, open for writing) fails with EROFS."""
    root = os.path.realpath(d)

    def under(path) -> bool:
        return isinstance(path, (str, bytes, os.PathLike)) and os.path.realpath(os.fsdecode(path)).startswith(root)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def guard(fn, nargs: int):
        def wrapped(*args, **kwargs):
            for a in args[:nargs]:
                if under(a):
                    refuse(a)
            return fn(*args, **kwargs)
        return wrapped

    for name, nargs in (("mkdir", 1), ("makedirs", 1), ("rename", 2), ("replace", 2), ("symlink", 2),
                        ("remove", 1), ("unlink", 1), ("rmdir", 1), ("utime", 1)):
        monkeypatch.setattr(os, name, guard(getattr(os, name), nargs))
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and under(path):
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def _fails_at(point: str, code: int):
    """The export's write fails with `code` at commit point `point` (files already written in its staging dir)."""
    def inject(monkeypatch, d):
        def crash(where):
            if where == point:
                raise OSError(code, os.strerror(code))
        monkeypatch.setattr(kvfmt, "_crash_point", crash)
    return inject


def _safetensors_fails(code: int):
    """The shard file's write fails as safetensors reports a full disk or a file-size limit: its own
    SafetensorError "... (os error N)", not an OSError (probe: a traceback per request and staging debris)."""
    def inject(monkeypatch, d):
        import safetensors.numpy
        from safetensors import SafetensorError

        def save_file(tensors, path, metadata=None):
            with open(path, "wb") as f:
                f.write(b"partial")  # some bytes reached the disk first
            raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
        monkeypatch.setattr(safetensors.numpy, "save_file", save_file)
    return inject


FAULTS = {
    "read-only": (_read_only, errno.EROFS),
    "disk-full-safetensors": (_safetensors_fails(errno.ENOSPC), errno.ENOSPC),
    "disk-full-shard": (_fails_at("shard_written", errno.ENOSPC), errno.ENOSPC),
    "quota-manifest": (_fails_at("manifest_written", errno.EDQUOT), errno.EDQUOT),
    "disk-full-version": (_fails_at("version_ready", errno.ENOSPC), errno.ENOSPC),
}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("slope_jax")]


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_unwritable_kv_dir_still_serves_and_reuses(engines, reference_engines, populated, monkeypatch, caplog,
                                                   fault):
    inject, code = FAULTS[fault]
    before = sorted(os.listdir(populated))
    prompts = [_turn(50, 1), _turn(52, 2)]
    want = reference_engines["A"].prefill(prompts, prefix_reuse=False)
    inject(monkeypatch, populated)
    with caplog.at_level(logging.WARNING):
        got = [engines[1].prefill([p], populated, ids=[f"q{i}"])[0] for i, p in enumerate(prompts)]
    for g, w in zip(got, want):
        assert g.first_token == w.first_token and np.abs(g.logits - w.logits).max() < TOL
        assert g.cached_tokens == 40  # the export already there still serves the prefix
        assert g.kv_path is None and os.strerror(code) in g.export_error and populated in g.export_error
    lines = _warnings(caplog)
    assert len(lines) == 1, lines  # the condition, once for the store: not once per request
    assert populated in lines[0] and os.strerror(code) in lines[0] and MEANING in lines[0]
    assert engines[1].kv_store(populated).write_error is not None
    monkeypatch.undo()
    assert sorted(os.listdir(populated)) == before  # no staging, version or link debris of q0, q1
    kv.load(os.path.join(populated, "doc"), CONFIG_A)  # the old export is whole


@pytest.mark.parametrize("where", ["under-a-file", "under-proc"])
def test_a_kv_dir_whose_parent_cannot_be_created_keeps_the_host_tier(checkpoints, reference_engines, tmp_path,
                                                                     caplog, where):
    # real kernel errors, also for root: makedirs fails with ENOTDIR under a regular file, with ENOENT under /proc
    (tmp_path / "a-file").write_text("not a directory")
    d = str(tmp_path / "a-file" / "kv") if where == "under-a-file" else f"/proc/slope-jax-{os.getpid()}/kv"
    eng = _engine(checkpoints)  # with its host tier (RAM), which a directory's condition does not touch
    prompt = _turn(50, 3)
    with caplog.at_level(logging.WARNING):
        first = eng.prefill([DOC], d, ids=["doc"])[0]
        hit = eng.prefill([prompt], d, ids=["turn"])[0]
    assert first.kv_path is None and ("Not a directory" if where == "under-a-file" else "cannot be created") in \
        first.export_error
    assert hit.cached_tokens == 40 and hit.kv_path is None  # served from the host tier
    want = reference_engines["A"].prefill([prompt], prefix_reuse=False)[0]
    assert hit.first_token == want.first_token and np.abs(hit.logits - want.logits).max() < TOL
    lines = _warnings(caplog)
    assert len(lines) == 1 and d in lines[0] and MEANING in lines[0], lines


def test_a_store_that_requires_exports_fails_the_request_by_name(engines, tmp_path, caplog):
    """The launcher's store (`exports_required`, its default): a decode engine reads every export, so a request whose
    export the directory refuses gets a RequestError naming the path and the error — once per request, warned once."""
    (tmp_path / "a-file").write_text("")
    d = str(tmp_path / "a-file" / "kv")
    engines[1].use_store(KVStore(d))
    with caplog.at_level(logging.WARNING):
        for rid in ("r0", "r1"):
            want = f"KV export {os.path.join(d, rid)!r} not written: {d!r} takes no writes (NotADirectoryError: "
            with pytest.raises(RequestError, match=re.escape(want) + r"\[Errno 20\] Not a directory"):
                engines[1].prefill([DOC], d, ids=[rid])
    lines = _warnings(caplog)
    assert len(lines) == 1 and "requests whose KV export it refuses fail" in lines[0], lines


def test_retention_keeps_what_a_read_only_kv_dir_cannot_remove(engines, populated, monkeypatch, caplog):
    engines[0].prefill([random_prompt(CONFIG_A, 30, seed=6)], populated, ids=["other"])
    before = sorted(os.listdir(populated))
    store = KVStore(populated, max_bytes=0, min_age_s=0)  # everything is over budget
    assert store.scan() == 2
    _read_only(monkeypatch, populated)
    with caplog.at_level(logging.WARNING):
        assert store.retain() == [] and store.retain() == []
    hashes = prefix_lib.block_hashes(DOC, engines[0].prefix_identity(None), BLOCK)
    assert store.lookup(hashes, BLOCK) == ("doc", 5)  # still indexed: still a prefix-cache entry
    lines = _warnings(caplog)
    assert len(lines) == 1 and os.strerror(errno.EROFS) in lines[0] and MEANING in lines[0], lines
    monkeypatch.undo()
    assert sorted(os.listdir(populated)) == before
    assert sorted(store.retain()) == ["doc", "other"]  # writable again: retention applies


def _chmod_binds(tmp_path) -> bool:
    """Whether `chmod 0555` stops this process from writing (not for root with CAP_DAC_OVERRIDE)."""
    probe = tmp_path / "probe"
    probe.mkdir()
    probe.chmod(0o555)
    try:
        (probe / "x").write_text("")
    except PermissionError:
        return True
    finally:
        probe.chmod(0o755)
    return False


def _rerun_without_dac_override(test: str) -> None:
    """Run `test` of this file in a child pytest whose root lacks CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH (dropped from
    the bounding set by util-linux's setpriv, so the execve'd child never gets them): there chmod binds as for any
    other user. Asserts that the child ran the test and it passed."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("chmod does not bind root and setpriv (util-linux) is missing; the EROFS simulation covers it")
    out = subprocess.run([setpriv, "--bounding-set", "-dac_override,-dac_read_search", sys.executable, "-m", "pytest",
                          "-q", "-n", "0", "-p", "no:cacheprovider", f"{os.path.abspath(__file__)}::{test}"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0 and "1 passed" in out.stdout and "skipped" not in out.stdout, (
        out.stdout[-3000:] + out.stderr[-3000:])


def test_chmod_read_only_kv_dir(engines, reference_engines, populated, caplog, tmp_path):
    if not _chmod_binds(tmp_path):  # root: the same test in a child without the capability that overrides chmod
        _rerun_without_dac_override("test_chmod_read_only_kv_dir")
        return
    before = sorted(os.listdir(populated))
    os.chmod(populated, 0o555)
    try:
        with caplog.at_level(logging.WARNING):
            got = [engines[1].prefill([_turn(50, i)], populated, ids=[f"q{i}"])[0] for i in (1, 2)]
    finally:
        os.chmod(populated, 0o755)
    want = reference_engines["A"].prefill([_turn(50, 1), _turn(50, 2)], prefix_reuse=False)
    for g, w in zip(got, want):
        assert g.first_token == w.first_token and g.cached_tokens == 40
        assert "Permission denied" in g.export_error
    assert len(_warnings(caplog)) == 1
    assert sorted(os.listdir(populated)) == before
