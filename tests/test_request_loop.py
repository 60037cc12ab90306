"""The request loop's boundary and isolation: per-line errors for any malformed input, the bounded batch wait, the
start-up fingerprint, per-request retry of a failed step, launcher errors (one line, exit 2) and prefill inputs that
differ across processes. The end-to-end fuzz runs (1 and 2 processes) are in test_launcher.py."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support import MALFORMED, MAX_TOKENS, REPO, SHIPPED, VALID_IN_MALFORMED, free_port, launcher_env
from tokenizers import Tokenizer

from slope_jax.checkpoints import writer
from slope_jax.serve import compute, fingerprint, requests
from slope_jax.serve.scheduler import Pending, Scheduler

PY = sys.executable


def test_every_malformed_line_is_its_own_error():
    tok = Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))
    seen: set[str] = set()
    errors, ok = [], []
    for n, raw in enumerate(MALFORMED, 1):
        try:
            ok.append(requests.parse(raw, n, vocab_size=1024, max_tokens=MAX_TOKENS, tokenizer=tok, seen_ids=seen))
        except requests.LineError as e:  # the only exception the boundary raises
            rec = requests.error_record(e)
            json.dumps(rec, allow_nan=False)  # strict JSON
            assert rec["line"] == n and rec["error"].startswith(f"line {n}")
            errors.append(rec)
    assert {r.id for r in ok} == VALID_IN_MALFORMED
    assert len(errors) == len(MALFORMED) - len(VALID_IN_MALFORMED) >= 40
    by_id = {r["id"]: r["error"] for r in errors if r["id"]}
    assert "outside the vocabulary" in by_id["f-int64"] and "lone surrogate U+D800" in by_id["f-surrogate"]
    assert "'tokens'[1] is 2.5 (float)" in by_id["f-float"] and "(bool)" in by_id["f-bool"]
    assert "101 tokens exceeds the limit of 100" in by_id["f-too-long"]
    assert "finite number > 0" in by_id["f-slo-zero"]
    texts = [r["error"] for r in errors]
    assert any("not valid UTF-8 (byte 0xff at offset 0)" in t for t in texts)
    assert any("1e400 overflows a float64" in t for t in texts)
    assert sum("Infinity is not allowed" in t or "NaN is not allowed" in t for t in texts) == 4
    dup = [r for r in errors if r.get("duplicate_of")]
    assert dup == [{"id": None, "line": len(MALFORMED), "error": dup[0]["error"], "duplicate_of": "dup-target"}]
    assert all(r["id"] is None or r["id"] not in VALID_IN_MALFORMED for r in errors)  # an id names one record


def test_a_byte_order_mark_and_crlf_endings_are_ignored():
    """A requests file saved as "UTF-8 with BOM" on Windows (CRLF line ends): its first line — and a line after a
    concatenated file's BOM — is a request, not a JSON error (RFC 8259 §8.1 lets a parser ignore the mark)."""
    seen: set[str] = set()
    got = [requests.parse(raw, n, vocab_size=1024, max_tokens=MAX_TOKENS, seen_ids=seen)
           for n, raw in enumerate([b'\xef\xbb\xbf{"id": "bom", "tokens": [1, 2, 3]}\r\n',
                                    '\ufeff{"id": "bom-text", "tokens": [4]}\r\n'], 1)]
    assert [(r.id, r.tokens.tolist()) for r in got] == [("bom", [1, 2, 3]), ("bom-text", [4])]


def test_text_literal_encodes_special_token_strings_as_text():
    tok = Tokenizer.from_file(os.path.join(SHIPPED, "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    line = '{"id": "x", "text": "a <|endoftext|> b"%s}'
    control = requests.parse(line % "", 1, vocab_size=1024, max_tokens=99, tokenizer=tok).tokens
    literal = requests.parse(line % ', "text_literal": true', 1, vocab_size=1024, max_tokens=99, tokenizer=tok).tokens
    assert eot in control and eot not in literal and len(literal) > len(control)
    assert tok.decode(literal.tolist()) == "a <|endoftext|> b"


def test_launcher_scheduler_waits_at_most_batch_wait_after_the_first_request():
    # the launcher's batching policy with no SLO: FCFS, bounded wait, never waiting for the batch to fill
    b = Scheduler(lambda lengths: 1.0, batch_size=4, batch_wait_ms=5, order="fcfs", slo_policy="none")

    def item(i, arrival):
        return Pending(i, str(i), 10, arrival)

    assert b.take_batch(10.0, closed=False) == ([], [], None)  # nothing pending: wait for input
    first = item(0, 10.0)
    b.add(first)
    batch, rejected, wait = b.take_batch(10.001, closed=False)
    assert batch == [] and rejected == [] and wait == pytest.approx(0.004)
    b.add(item(1, 10.002))
    batch, _, _ = b.take_batch(10.005, closed=False)  # first request's wait is over: go with what is there
    assert len(batch) == 2 and batch[0] is first
    b.finished(10.1)
    for i in range(6):
        b.add(item(2 + i, 11.0))
    batch, _, _ = b.take_batch(11.0, closed=False)
    assert len(batch) == 4  # full: no wait at all
    b.finished(11.1)
    assert len(b.take_batch(11.1, closed=True)[0]) == 2  # input closed: no wait either


def test_fingerprint_compare_names_each_differing_field(checkpoints, tmp_path):
    base = {"dtype": "bfloat16", "ring": 2, "q_tile": 256, "kv_export": True, "checkpoint.tensors": "aa"}
    same = fingerprint.compare({0: base, 1: dict(base), 2: dict(base)})
    assert same == []
    fps = {0: base, 1: dict(base, q_tile=128, kv_export=False), 2: dict(base, q_tile=128)}
    assert fingerprint.compare(fps) == ["kv_export: processes 0, 2 have True; process 1 has False",
                                        "q_tile: process 0 has 256; processes 1, 2 have 128"]
    # a checkpoint with the same shapes but other weights has another fingerprint; the same files the same one
    from support import CONFIG_A

    other = str(tmp_path / "other")
    writer.write_hf(other, CONFIG_A, writer.random_params(CONFIG_A, seed=1234), experts="mxfp4", num_shards=3)
    copy = shutil.copytree(checkpoints["A"]["mxfp4"], tmp_path / "copy")
    a, b, c = (fingerprint.checkpoint_fingerprint(p) for p in (checkpoints["A"]["mxfp4"], other, copy))
    assert a == c  # content, not path
    # no weight byte is read before loading: a copy with one weight byte changed has the same fingerprint; the bytes
    # are compared in full after loading (test_two_processes_with_different_weight_bytes_refuse_to_start)
    changed = shutil.copytree(checkpoints["A"]["mxfp4"], tmp_path / "changed")
    from safetensors import safe_open

    shard = sorted(f for f in os.listdir(changed) if f.endswith(".safetensors"))[0]
    with safe_open(os.path.join(changed, shard), "numpy") as h:
        name = sorted(h.keys())[0]
    _flip_one_weight_byte(os.path.join(changed, shard), name)
    assert fingerprint.checkpoint_fingerprint(str(changed)) == a
    # converted (orbax) directories: identified by their marker, which carries the source's content digest
    from slope_jax.checkpoints import orbax_store

    conv = {}
    for name, src in (("a", checkpoints["A"]["mxfp4"]), ("other", other)):
        conv[name] = str(tmp_path / f"ob-{name}")
        orbax_store.convert(src, conv[name], progress=False)
    oa, ob = (fingerprint.checkpoint_fingerprint(conv[k]) for k in ("a", "other"))
    ocopy = fingerprint.checkpoint_fingerprint(shutil.copytree(conv["a"], tmp_path / "ob-copy"))
    assert oa["checkpoint.tensors"] != ob["checkpoint.tensors"]  # equal shapes, other weights: other source id
    assert oa == ocopy and oa["checkpoint.config"] == ob["checkpoint.config"]
    assert oa["checkpoint.tensors"] != a["checkpoint.tensors"]  # a converted directory is not its source


class _FlakyEngine:
    """Stands in for PrefillEngine: a step holding a prompt that starts with 13 fails (as a step-time failure would)."""

    mesh = object()

    class parallel:
        in_flight = 3

    def __init__(self):
        self.calls = []

    def bucket(self, n):
        return 16 if n <= 16 else 32

    def prefill(self, prompts, ids, arrival_times=None, **kw):
        self.calls.append(list(ids))
        if any(p[0] == 13 for p in prompts):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory in the step")
        return [f"result-{i}" for i in ids]


def test_broadcast_reassembles_values_longer_than_one_chunk():
    """`compute.Broadcast` sends a value as its byte length and fixed-size chunks (two compiled collectives however
    large a batch is); the chunks reassemble into the value at every size around the chunk boundaries (one process:
    the collectives are the identity, the chunking is what is checked)."""
    b = compute.Broadcast(True)
    b.CHUNK = 64
    for size in (1, 50, 63, 64, 65, 200, 640):
        value = {"ids": "x" * size, "n": [size, None]}
        assert b(value) == value, size
    b.warm()  # compiles the collectives ahead of the first batch; no effect on later values
    assert b([["r", [1, 2, 3]]]) == [["r", [1, 2, 3]]] and compute.Broadcast(False)(None) is None


def test_a_failing_step_is_retried_per_request_and_blamed_on_one():
    eng = _FlakyEngine()
    prompts = [[1] * 5, [13] * 6, [2] * 7, [3] * 20, [4] * 3]
    ids = ["a", "bad", "c", "long", "e"]
    out = compute.prefill_isolated(eng, [compute.BatchItem(i, p) for i, p in zip(ids, prompts)], top_k=5)
    assert out[0] == "result-a" and out[2] == "result-c" and out[3] == "result-long" and out[4] == "result-e"
    assert out[1].startswith("prefill failed: RuntimeError: RESOURCE_EXHAUSTED")
    # steps of one bucket and at most in_flight prompts; the failed step is retried one request at a time
    assert eng.calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"], ["e"], ["long"]]


def _launch1(args, **kw):
    return subprocess.run([PY, "-m", "slope_jax.launch", *args], cwd=REPO, env=launcher_env(), capture_output=True,
                          text=True, timeout=300, **kw)


def test_flag_and_layout_mistakes_are_one_line_exit_2():
    for args, message in [
        (["--cpu_devices=8", "--ring=3", "--ulysses=4"],
         "slope_jax: error: pipeline*ring*ulysses = 1*3*4 = 12 devices"),
        (["--cpu_devices=6", "--ring=2", "--ulysses=3"], "slope_jax: error: ulysses=3 must divide"),
        (["--cpu_devices=1", "--max_tokens=200000"],
         "slope_jax: error: --max_tokens=200000 exceeds the model's max_position_embeddings=131072"),
        (["--batch_wait_ms=-1"], "slope_jax: error: --batch_wait_ms=-1.0: must be >= 0"),
    ]:
        r = _launch1(args)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert message in r.stderr and "Traceback" not in r.stderr and "died" not in r.stderr, r.stderr[-2000:]


_SPAWNED: list = []  # launcher processes of the running test, killed at its end even when it fails


@pytest.fixture(autouse=True)
def _reap_launchers():
    yield
    while _SPAWNED:
        p = _SPAWNED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()


def _pair(args0, args1, port, extra=(), **popen):
    procs = {}
    for pid, args in ((1, args1), (0, args0)):
        cmd = [PY, "-m", "slope_jax.launch", "--num_processes=2", f"--process_id={pid}",
               f"--coordinator_address=127.0.0.1:{port}", "--init_timeout=60", *extra, *args]
        procs[pid] = subprocess.Popen(cmd, cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, **({"stdin": subprocess.DEVNULL} | popen))
        _SPAWNED.append(procs[pid])
    return procs


def test_two_processes_that_differ_fail_fast_naming_the_field():
    for field, a, b, expect in [("dtype", "--dtype=bfloat16", "--dtype=float32",
                                 "dtype: process 0 has 'bfloat16'; process 1 has 'float32'"),
                                ("ring", "--ring=2", "--ring=4", "ring: process 0 has 2; process 1 has 4")]:
        t0 = time.time()
        procs = _pair([a, "--cpu_devices=4"], [b, "--cpu_devices=4"], free_port())
        outs = {pid: p.communicate(timeout=120) for pid, p in procs.items()}
        assert time.time() - t0 < 30, field  # before JAX starts: no hang, no init timeout
        for pid, p in procs.items():
            err = outs[pid][1]
            assert p.returncode == 2 and "processes disagree on what to run" in err and expect in err, err[-2000:]
            assert "Traceback" not in err


def _flip_one_weight_byte(path: str, tensor: str) -> None:
    """Change one byte in the middle of `tensor`'s data in a safetensors file (the lowest bit of a bf16 mantissa:
    same header, same size, a slightly different weight)."""
    import struct

    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        lo, hi = json.loads(f.read(n))[tensor]["data_offsets"]
        at = 8 + n + (lo + hi) // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))


def test_two_processes_with_different_weight_bytes_refuse_to_start(tmp_path):
    """Two copies of the checkpoint that differ in one byte of one tensor (same config, same headers, so the
    start-up fingerprint agrees): both processes refuse to start within 30 s naming the tensor and the processes.
    Every tensor is hashed as read, byte-identical copies read identical digests, the changed copy differs in
    exactly the changed tensor."""
    tensor = "model.layers.3.self_attn.o_proj.weight"
    copies = {name: str(shutil.copytree(SHIPPED, tmp_path / name)) for name in ("a", "b", "c")}
    _flip_one_weight_byte(os.path.join(copies["c"], "model.safetensors"), tensor)
    common = ["--cpu_devices=4", "--ring=2", "--ulysses=4", "--dtype=float32"]
    t0 = time.time()
    procs = _pair([f"--checkpoint={copies['a']}", *common], [f"--checkpoint={copies['c']}", *common], free_port())
    outs = {pid: p.communicate(timeout=120) for pid, p in procs.items()}
    assert time.time() - t0 < 30  # at load time, before any compile
    for pid, p in procs.items():
        err = outs[pid][1]
        lines = [x for x in err.splitlines() if x.startswith("slope_jax: error:")]
        assert p.returncode == 2 and len(lines) == 1, err[-2000:]
        assert "processes read different weights" in lines[0] and f"tensor {tensor}" in lines[0], lines
        assert "process 0 read" in lines[0] and "process 1 read" in lines[0] and "Traceback" not in err, lines
    # byte-identical copies read identical digests (every other 2-process test starts from one checkpoint through
    # the same comparison); the changed copy differs in exactly that tensor
    from slope_jax.checkpoints import digest, hf

    reads = {}
    for name, path in copies.items():
        reads[name] = digest.ReadDigests()
        hf.load_params(hf.open_checkpoint(path), "float32", progress=False, reads=reads[name])
    from safetensors import safe_open

    with safe_open(os.path.join(SHIPPED, "model.safetensors"), "numpy") as h:
        stored = {n: h.get_slice(n) for n in h.keys()}
        size = {"U8": 1, "BF16": 2, "F16": 2, "F32": 4}
        data_bytes = sum(int(np.prod(sl.get_shape())) * size[sl.get_dtype()] for sl in stored.values())
    assert {label.split("[")[0] for label in reads["a"].digests} == set(stored)  # every tensor hashed as read
    assert reads["a"].nbytes >= data_bytes
    assert digest.compare_reads({0: reads["a"].digests, 1: reads["b"].digests}) == []
    problems = digest.compare_reads({0: reads["a"].digests, 1: reads["c"].digests})
    assert len(problems) == 1 and problems[0].startswith(f"tensor {tensor}: process 0 read"), problems


def test_layout_mistake_in_two_processes_is_reported_as_is():
    procs = _pair(["--cpu_devices=4", "--ring=2", "--ulysses=2"], ["--cpu_devices=4", "--ring=2", "--ulysses=2"],
                  free_port())
    for p in procs.values():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 2, err[-2000:]
        # one line each: the process's own error, or (if a peer got there first) the peer's, named as such
        lines = [x for x in err.splitlines() if x.startswith("slope_jax: error:")]
        assert len(lines) == 1 and "pipeline*ring*ulysses = 1*2*2 = 4 devices, but 8 are available" in lines[0], err
        assert "Traceback" not in err and "died" not in err, err[-2000:]


def _read_until(proc, text: str, deadline: float) -> str:
    """Reads proc's stderr until `text` appears. Raw os.read on the descriptor, not readline: a buffered readline can
    pull the awaited line into Python's buffer together with the one before it, after which select() never fires."""
    seen, fd = "", proc.stderr.fileno()
    while text not in seen:
        assert time.time() < deadline and proc.poll() is None, seen[-2000:]
        if select.select([fd], [], [], 1.0)[0]:
            seen += os.read(fd, 1 << 16).decode(errors="replace")
    return seen


@pytest.mark.parametrize("sig", [signal.SIGINT])  # SIGTERM (143) takes the same path; Ctrl-C once aborted in XLA
def test_a_signal_while_waiting_ends_both_processes_promptly(sig):
    """Process 0 waits on stdin (kept open), process 1 waits in the batch broadcast: SIGINT (Ctrl-C) to process 1 ends
    it at once (status 130, one line), and process 0 stops naming it."""
    procs = _pair(["--cpu_devices=4"], ["--cpu_devices=4"], free_port(), extra=["--ring=2", "--ulysses=4"],
                  stdin=subprocess.PIPE)
    _read_until(procs[0], "reading requests from stdin", time.time() + 240)  # absl logs to stderr
    time.sleep(1.0)  # let process 1 reach the broadcast
    procs[1].send_signal(sig)
    t0 = time.time()
    _, err1 = procs[1].communicate(timeout=30)
    name = signal.Signals(sig).name
    assert procs[1].returncode == 128 + sig and f"terminated by {name}" in err1 and time.time() - t0 < 10
    assert "Traceback" not in err1 and "Fatal Python error" not in err1, err1[-2000:]
    _, err0 = procs[0].communicate(timeout=30)
    assert time.time() - t0 < 15
    assert procs[0].returncode == 2
    assert f"process 0: process 1 stopped with an error: terminated by {name}" in err0, err0[-2000:]


def test_first_request_is_not_held_back_for_a_later_one():
    """stdin through a pipe: one request, then a second 3 s later. The first one's result comes before the second is
    sent, and its TTFT is at most --batch_wait_ms + its compute (plus slack for parsing on a busy machine)."""
    wait_ms = 20
    p = subprocess.Popen([PY, "-m", "slope_jax.launch", "--cpu_devices=1", "--dtype=float32", "--precompile=10",
                          f"--batch_wait_ms={wait_ms}", "--batch_size=8"], cwd=REPO, env=launcher_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _read_until(p, "reading requests from stdin", time.time() + 240)
        p.stdin.write(json.dumps({"id": "first", "tokens": [5, 6, 7, 8]}) + "\n")
        p.stdin.flush()
        assert select.select([p.stdout], [], [], 60)[0], "no result for the first request"
        first = json.loads(p.stdout.readline())
        time.sleep(3)
        p.stdin.write(json.dumps({"id": "second", "tokens": [9, 10]}) + "\n")
        p.stdin.close()
        second = json.loads(p.stdout.readline())
        assert p.wait(timeout=60) == 0
        err = p.stderr.read()
    finally:
        p.kill()
    assert first["id"] == "first" and second["id"] == "second"
    assert first["compile_ms"] < 1.0  # --precompile covered its bucket
    assert "cost model seeded by 1 warm-up step(s)" in err  # and ran it, so predictions start from its time
    assert first["ttft_ms"] < wait_ms + first["compute_ms"] + 200, first  # measured: ~wait + compute + ~1 ms


API_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
from slope_jax.serve import distributed
pid, port, ckpt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
distributed.initialize(f"127.0.0.1:{port}", 2, pid, init_timeout_s=60, heartbeat_timeout_s=10)
import slope_jax
engine = slope_jax.PrefillEngine.from_checkpoint(ckpt, slope_jax.ParallelConfig(ring=2, ulysses=4), "float32",
                                                 progress=False)
prompt = [1, 2, 3] if pid == 0 else [1, 2, 4]
try:
    engine.prefill([prompt, [7] * 9])
except slope_jax.RequestError as e:
    print("REQUEST_ERROR", e, flush=True)
    sys.exit(0)
print("NO ERROR", flush=True)
sys.exit(1)
"""


def test_api_prompts_that_differ_across_processes_raise(tmp_path):
    script = tmp_path / "api.py"
    script.write_text(API_SCRIPT)
    port = free_port()
    procs = [subprocess.Popen([PY, str(script), str(pid), str(port), SHIPPED], cwd=REPO, env=launcher_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in (1, 0)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (out + err)[-3000:]
        assert "REQUEST_ERROR prefill: the processes passed different prompts" in out
        assert "process(es) [0]" in out and "process(es) [1]" in out


def test_both_entry_points_show_the_same_help():
    texts = []
    for cmd in ([PY, "-m", "slope_jax.launch", "--help"], [os.path.join(os.path.dirname(PY), "slope-jax"), "--help"]):
        r = subprocess.run(cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=120)
        text = r.stdout + r.stderr
        texts.append(text.replace(cmd[0] if "slope-jax" in cmd[0] else "", ""))
        assert "slope_jax launcher" in text and "--batch_wait_ms" in text and "launch/local.sh" in text, text[:2000]
        assert "echo '{\"id\": \"a\", \"text\": \"Hello\"}' | slope-jax" in text
    usage = [t[:t.index("flags:")] for t in texts]
    assert usage[0] == usage[1]


class _Flag:
    def __init__(self, value, present=False):
        self.value, self.present = value, present


def _flag_values(**given):
    """A stand-in for parsed absl flags: every launcher flag at its default, `given` ones as if on the command line
    (the global FLAGS stay unparsed in this process)."""
    from absl import flags

    from slope_jax.serve import launch_config

    names = [f.name for f in flags.FLAGS.flags_by_module_dict()[launch_config.__name__]]
    fv = {name: _Flag(flags.FLAGS[name].default) for name in names}
    fv.update({name: _Flag(value, True) for name, value in given.items()})
    return fv


def test_launch_config_is_the_flags_once_validated():
    """`LaunchConfig.from_flags`: one field per flag with the flag's default, the fingerprint options are the flags'
    values under the same names, and each mistake is a FlagError naming the flag and its limit."""
    from slope_jax.model.options import StepOptions
    from slope_jax.serve.launch_config import STEP_FLAGS, FlagError, LaunchConfig

    config = LaunchConfig.from_flags(_flag_values())
    assert config == LaunchConfig()  # the dataclass defaults are the flags' defaults
    fv = _flag_values(ring=2, ulysses=4, q_tile=32, expected_lengths=["64", "128"], kv_dir="kv", layout="auto",
                      ttft_slo_ms=500.0)
    config = LaunchConfig.from_flags(fv)
    options = config.fingerprint_options()
    assert list(options) == [*STEP_FLAGS, "kv_export"] and options["kv_export"] is True
    assert all(options[name] == fv[name].value for name in STEP_FLAGS), options
    assert config.step_options == StepOptions(q_tile=32) and config.expected_length_values == [64, 128]
    assert config.kv_store().kv_dir == "kv" and LaunchConfig().kv_store() is None
    for given, message in [({"batch_size": 0}, "--batch_size=0: must be > 0"),
                           ({"q_tile": 0}, "--q_tile=0: must be a positive integer"),
                           ({"device_memory_gib": -1.0}, "--device_memory_gib=-1.0: must be a finite number > 0"),
                           ({"layout": "auto"}, "--layout=auto needs --ttft_slo_ms"),
                           ({"precompile": ["12", "x"]}, "--precompile: 'x' is not a positive prompt length"),
                           ({"process_id": 2}, "--process_id=2: must be in 0..0"),
                           ({"http_port": 8100}, "--http_port needs --kv_dir"),
                           ({"kv_dir": "kv", "kv_dir_max_gib": float("inf")},
                            "--kv_dir_max_gib=inf: must be a finite number > 0"),
                           ({"kv_dir_max_age_h": 2.0}, "--kv_dir_max_age_h needs --kv_dir"),
                           ({"kv_dir": ""}, "--kv_dir='': must name a directory"),
                           ({"kv_dir": __file__}, f"--kv_dir={__file__}: exists and is not a directory")]:
        with pytest.raises(FlagError, match=message.replace("(", r"\(").replace(".", r"\.")):
            LaunchConfig.from_flags(_flag_values(**given))


def test_memory_admission_predicts_without_compiling():
    """The intake's memory check is the planner's prediction per bucket (memoised), never a compile; the refusal
    names the tokens, the predicted GiB and the budget."""
    from slope_jax.serve.admission import MemoryAdmission

    calls = []

    def predict_bytes(t, m):
        calls.append((t, m))
        return t * 2**20  # 1 MiB per padded token

    adm = MemoryAdmission(predict_bytes, lambda n: 32 * -(-n // 32), 2, budget_bytes=64 * 2**20)
    assert adm.refusal(40) is None and adm.refusal(60) is None  # bucket 64: 64 MiB fits
    reason = adm.refusal(65)
    assert reason.startswith("65 tokens (bucket 96) need a predicted 0.094 GiB per device"), reason
    assert "over the budget of 0.062 GiB (--device_memory_gib)" in reason
    assert calls == [(64, 2), (96, 2)]  # one prediction per bucket
    assert MemoryAdmission(predict_bytes, lambda n: n, 1, budget_bytes=None).refusal(10**9) is None
