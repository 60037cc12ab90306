"""Entries of a KV directory that are not what the export format writes (issue 30 point 9, found by an outside-in
probe): a link to a directory elsewhere, a manifest that is a FIFO or JSON nested too deeply, a file-size limit
reached while a shard is written. None of them may stop the store, hang it, be read as an export or make retention
(or the HTTP endpoint's release) delete anything outside the directory; each is named once in the log."""

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
from support import REPO

from slope_jax.kv import format as kvfmt
from slope_jax.kv.store import KVStore, unwritable
from slope_jax.model.config import ModelConfig

CFG = ModelConfig.from_json(os.path.join(REPO, "checkpoints", "tiny-gpt-oss-hd64", "config.json"))
NONCE = "0123456789abcdef"
BLOCK = 4


def _export(kv_dir: str, rid: str, n: int = 9, prefix: bool = True) -> str:
    """A complete export of random KV for n tokens (with prefix-reuse block hashes unless not `prefix`: a P/D
    export the decode side consumes), published as the engine does."""
    tokens = np.arange(5, 5 + n, dtype=np.int32)
    staging = kvfmt.staging_dir(kv_dir, rid, NONCE, 0)
    rng = np.random.default_rng(0)
    segments = [(layer, 0, n, rng.normal(size=(n, CFG.num_key_value_heads, CFG.head_dim)).astype(np.float32),
                 rng.normal(size=(n, CFG.num_key_value_heads, CFG.head_dim)).astype(np.float32))
                for layer in range(CFG.num_hidden_layers)]
    name, records = kvfmt.write_shard_file(staging, 0, segments, token_ids=tokens)
    kvfmt.write_manifest(staging, request_id=rid, token_ids=tokens, cfg=CFG, dtype="float32", full=True,
                         segments=records, files=[name], run_nonce=NONCE,
                         prefix={"block_size": BLOCK, "hashes": [f"{i:032x}" for i in range(n // BLOCK)]}
                         if prefix else None)
    return kvfmt.publish(kv_dir, rid, staging, overwrite=False)


def _skipped(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not used for prefix reuse" in r.getMessage()]


def test_retention_and_release_never_follow_a_link_out_of_the_kv_dir(tmp_path, caplog):
    """Links `<kv_dir>/abs` and `<kv_dir>/rel` to valid exports elsewhere (with a file beside them): retention with
    a zero budget removed them and everything in their targets (probe, severity high). Now neither is indexed nor
    removed, each is named once, and the export really in the directory is still evicted."""
    kv_dir, outside = str(tmp_path / "kv"), tmp_path / "elsewhere"
    os.mkdir(kv_dir)
    _export(kv_dir, "inside")
    for name in ("abs", "rel"):
        os.makedirs(outside / name)
        shutil.copytree(os.path.realpath(_export(kv_dir, name)), outside / name / name)
        (outside / name / "precious.txt").write_text("keep me")
        os.remove(os.path.join(kv_dir, name))  # its own pointer; the version directory is swept later
    os.symlink(outside / "abs" / "abs", os.path.join(kv_dir, "abs"))
    os.symlink(os.path.join("..", "elsewhere", "rel", "rel"), os.path.join(kv_dir, "rel"))
    store = KVStore(kv_dir, max_bytes=0, min_age_s=0)
    with caplog.at_level(logging.WARNING, logger="slope_jax.kv.store"):
        assert store.scan() == 1
        assert store.retain() == ["inside"]
        store.retain()
    for name in ("abs", "rel"):
        assert (outside / name / "precious.txt").read_text() == "keep me"
        kvfmt.load(str(outside / name / name))  # whole
        assert os.path.islink(os.path.join(kv_dir, name))
        assert "not an export pointer" in store.skipped[name]
    lines = _skipped(caplog)
    assert len(lines) == 2 and all("not an export pointer" in x for x in lines), lines


def test_the_http_release_of_a_foreign_link_removes_nothing_through_it(tmp_path):
    """`/v1/kv/release` (`HttpIntake.reclaim`) removed the realpath of the named entry: through a link, a directory
    outside kv_dir."""
    from slope_jax.serve.http import HttpIntake

    kv_dir, outside = str(tmp_path / "kv"), tmp_path / "elsewhere"
    os.mkdir(kv_dir)
    src = os.path.realpath(_export(kv_dir, "x", prefix=False))
    shutil.copytree(src, outside / "x")
    os.remove(os.path.join(kv_dir, "x"))
    os.symlink(outside / "x", os.path.join(kv_dir, "x"))
    intake = HttpIntake.__new__(HttpIntake)  # reclaim's state only: no server
    intake._limits = {"kv_store": KVStore(kv_dir)}
    intake._lock, intake._entries, intake._peer_drops = threading.Lock(), {}, {}
    intake._exporting, intake._reclaim_when_written, intake.kv_pool = set(), set(), None
    removed, why = intake.reclaim("x")
    assert not removed and "not an export pointer" in why
    kvfmt.load(str(outside / "x"))


def test_a_fifo_or_deeply_nested_manifest_is_skipped_by_name(tmp_path, caplog):
    """A FIFO named manifest.json hung the store's start-up forever; a manifest of 100,000 nested lists raised
    RecursionError out of it (the launcher exited). Both are now entries that are skipped with their reason."""
    kv_dir = str(tmp_path / "kv")
    os.mkdir(kv_dir)
    _export(kv_dir, "good")
    for name in ("fifo", "deep"):
        os.mkdir(os.path.join(kv_dir, name))  # plain directories: how version-2 exports are laid out
    os.mkfifo(os.path.join(kv_dir, "fifo", kvfmt.MANIFEST))
    with open(os.path.join(kv_dir, "deep", kvfmt.MANIFEST), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    store, counted = KVStore(kv_dir), []
    with caplog.at_level(logging.WARNING, logger="slope_jax.kv.store"):
        t = threading.Thread(target=lambda: counted.append(store.scan()), daemon=True)
        t.start()
        t.join(timeout=30)
    assert counted == [1], "the store's scan did not finish (blocked on the FIFO?)"
    assert "not a regular file" in store.skipped["fifo"] and "nested too deeply" in store.skipped["deep"]
    assert len(_skipped(caplog)) == 2


def test_a_file_size_limit_during_a_shard_write_is_an_unwritable_directory(tmp_path):
    """Under `ulimit -f`, safetensors raised its own SafetensorError "(os error 27)", which the export's handling of
    a directory that takes no writes did not recognise (a traceback per request). It is now an OSError with its
    errno; nothing of the shard is left."""
    script = (f"import resource, sys; sys.path.insert(0, {REPO!r}); import numpy as np\n"
              "from slope_jax.kv import format as kvfmt\n"
              "from slope_jax.kv.store import unwritable\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
              f"d = {str(tmp_path / '.tmp-0123456789abcdef-0.x')!r}\n"
              "kv = np.zeros((100, 8, 64), np.float32)\n"
              "try:\n"
              "    kvfmt.write_shard_file(d, 0, [(0, 0, 100, kv, kv)])\n"
              "except OSError as e:\n"
              "    print('errno', e.errno, unwritable(e))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["errno", str(errno.EFBIG), "True"], r.stdout + r.stderr
    assert os.listdir(tmp_path / ".tmp-0123456789abcdef-0.x") == []  # the partial file is gone
    assert unwritable(OSError(errno.EFBIG, "File too large"))


def test_a_skipped_entry_is_logged_once_and_forgotten_when_fixed(tmp_path, caplog):
    kv_dir = str(tmp_path / "kv")
    os.mkdir(kv_dir)
    _export(kv_dir, "a")
    mpath = os.path.join(os.path.realpath(os.path.join(kv_dir, "a")), kvfmt.MANIFEST)
    good = open(mpath).read()
    with open(mpath, "w") as f:
        f.write("{not json")
    store = KVStore(kv_dir)
    with caplog.at_level(logging.WARNING, logger="slope_jax.kv.store"):
        assert store.scan() == 0
        store.refresh(), store.lookup(["0" * 32], BLOCK)
    assert len(_skipped(caplog)) == 1 and "not valid JSON" in store.skipped["a"]
    with open(mpath, "w") as f:  # repaired and re-published under the same id: indexed again
        f.write(good)
    os.remove(os.path.join(kv_dir, "a"))
    time.sleep(0.01)
    os.symlink(os.path.basename(os.path.dirname(mpath)), os.path.join(kv_dir, "a"))
    assert store.scan() == 1 and "a" not in store.skipped
