"""A newcomer's first runs: `--help` exits 0 on every entry point, a second run never clobbers the first one's results
(refused, naming --overwrite, before the weights are read; `--overwrite` runs are covered by the README's
command 1), a run in which every request failed exits 1, backend
noise (Gloo's connection lines on stdout) is filtered without touching other output, and JSON errors read cleanly."""

import json
import os
import subprocess
import sys

import pytest
from support import REPO, launcher_env

from slope_jax.serve import requests

PY = sys.executable


@pytest.mark.parametrize("module,text", [("slope_jax.launch", "--coordinator_address"),
                                         ("slope_jax.convert", "--out"),
                                         ("slope_jax.decode", "--max_new_tokens"),
                                         ("slope_jax.plan", "--ttft_slo_ms")])
def test_help_exits_zero(module, text):
    r = subprocess.run([PY, "-m", module, "--help"], cwd=REPO, env=launcher_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert text in r.stdout
    if module == "slope_jax.launch":  # only help became 0: a flag mistake still fails
        bad = subprocess.run([PY, "-m", module, "--no_such_flag"], cwd=REPO, env=launcher_env(), capture_output=True,
                             text=True, timeout=120)
        assert bad.returncode != 0


@pytest.mark.parametrize("script,text", [("slope-plan", "--ttft_slo_ms"), ("slope-convert", "--out"),
                                         ("slope-pd-proxy", "--prefill_url")])
def test_console_scripts_explain_themselves(script, text):
    """The console scripts print their tool's description and flags (`slope-plan --help` printed one USAGE line;
    the proxy's --help exited 1), and a usage mistake is one line with status 2."""
    path = os.path.join(os.path.dirname(PY), script)
    r = subprocess.run([path, "--help"], cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and text in r.stdout and len(r.stdout.splitlines()) > 20, (r.stdout + r.stderr)[-2000:]
    r = subprocess.run([path, "--no_such_flag"], cwd=REPO, env=launcher_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "error: Unknown command line flag 'no_such_flag'" in r.stderr, r.stderr[-2000:]


def test_usage_mistakes_are_one_line_and_exit_2(tmp_path):
    """Every entry point: a flag absl cannot parse, a value the tool refuses, a path it cannot use or a platform JAX
    cannot start is one line `<tool>: error: ...` naming the flag, exit status 2 (1 means "no request was served"),
    before any weight is read; no traceback, no help text dumped before the reason."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "one").mkdir()
    (tmp_path / "empty").mkdir()
    (tmp_path / "one" / "manifest.json").write_text("{}")
    cases = [
        ("slope_jax.launch", ["--prefix_block=0"], "flag --prefix_block=0: 0 is not a positive integer"),
        ("slope_jax.launch", ["--no_such_flag"], "Unknown command line flag 'no_such_flag'"),
        ("slope_jax.launch", ["--platform=nope"], "--platform=nope: JAX could not start that backend"),
        ("slope_jax.launch", ["--hardware=nope"], "unknown hardware 'nope'"),
        ("slope_jax.launch", ["--precompile=200000"], "--precompile=200000: longer than the longest accepted prompt"),
        ("slope_jax.launch", [f"--logits_dir={tmp_path / 'a-file' / 'x'}"], "--logits_dir="),
        ("slope_jax.plan", ["--lengths=0"], "--lengths: need at least one positive length"),
        ("slope_jax.plan", ["--percentile=100"], "--percentile=100.0: must be a percent in [1, 100)"),
        ("slope_jax.plan", ["--ttft_slo_ms=nan"], "--ttft_slo_ms=nan: must be a finite number"),
        ("slope_jax.plan", [f"--json={tmp_path / 'a-file' / 'p.json'}"], "is not a writable directory"),
        ("slope_jax.plan", ["calibrate", f"--measured={tmp_path / 'a-file'}"], "--measured="),  # JSON traceback
        ("slope_jax.plan", [f"--png={tmp_path / 'plan.svg'}"], "the figure is a PNG"),  # PNG bytes in a .svg
        ("slope_jax.plan", ["calibrate", f"--measured={tmp_path / 'one' / 'manifest.json'}"], "a \"rows\" list"),
        ("slope_jax.convert", ["--checkpoint=checkpoints/tiny-gpt-oss", "--out=checkpoints/tiny-gpt-oss"],
         "is the source checkpoint"),
        ("slope_jax.decode", [f"--kv_dir={tmp_path}", "--requests=/nonexistent"], "--requests=/nonexistent: no such"),
        ("slope_jax.decode", [f"--kv_dir={tmp_path / 'empty'}"], "no exports in it"),  # it said "0 decoded, 0 failed"
        ("slope_jax.decode", [f"--kv_dir={tmp_path / 'one'}"], "no exports in it (it is an export itself"),
        ("slope_jax.convert", ["--checkpoint=checkpoints/tiny-gpt-oss", f"--out={tmp_path / 'a-file' / 'x'}"],
         "is not a writable directory"),
    ]
    for module, args, message in cases:
        extra = ["--cpu_devices=1", "--requests=/dev/null"] if module == "slope_jax.launch" else []
        r = subprocess.run([PY, "-m", module, *extra, *args], cwd=REPO, env=launcher_env(), capture_output=True,
                           text=True, timeout=120)
        lines = [x for x in r.stderr.splitlines() if x.startswith(f"{module.replace('.launch', '')}: error: ")]
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], (module, args, r.stderr[-2000:])
        assert "Traceback" not in r.stderr and "--helpfull" not in r.stderr, (module, args, r.stderr[-2000:])
    for n in ("0", "two"):  # launch/local.sh's process count
        r = subprocess.run(["bash", "launch/local.sh", n, "--cpu_devices=1"], cwd=REPO, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and f"NUM_PROCESSES={n}: must be a positive integer" in r.stderr, r.stderr
    r = subprocess.run(["bash", "launch/hostfile.sh", str(tmp_path / "no-hosts.txt")], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "no-hosts.txt: no such readable file" in r.stderr, r.stderr


def test_rerun_refuses_to_clobber_results_and_all_failed_exits_1(tmp_path):
    reqs = tmp_path / "bad.jsonl"
    reqs.write_text('{"id": "a", "tokens": [1, 2, 999999]}\n{"id": "b" "tokens": [1]}\n')
    results = tmp_path / "out" / "results.jsonl"
    cmd = [PY, "-m", "slope_jax.launch", "--cpu_devices=1", f"--requests={reqs}", f"--results={results}",
           f"--kv_dir={tmp_path / 'kv'}"]
    first = subprocess.run(cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 1, first.stderr[-3000:]  # every request failed: not a success
    assert "no request was served (2 error record(s): all failed); exit status 1" in first.stderr
    records = [json.loads(x) for x in results.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2] and all("error" in r for r in records)
    before = results.read_bytes()
    second = subprocess.run(cmd, cwd=REPO, env=launcher_env(), capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"--results={results} already holds an earlier run's results: pass --overwrite" in second.stderr
    assert "loading weights" not in second.stderr  # refused before the checkpoint is read
    assert results.read_bytes() == before


_GLOO = "[Gloo] Rank {} is connected to {} peer ranks. Expected number of connected peer ranks is : {}\n"
_WRITER = r"""
import os, sys
from slope_jax import cli
cli.quiet(gloo=True)
os.write(1, b"keep 1\n" + sys.argv[1].encode() + b"keep 2 [Gloo] not a connection line\n")
print("keep 3", flush=True)
os.write(1, sys.argv[1].encode())
print(7, flush=True)  # a line of digits after the debris is kept
sys.stdout.write("keep 4 (no newline)")
"""


def test_gloo_lines_are_dropped_and_the_rest_kept_in_order():
    inner = _GLOO.format(0, 3, 3)
    interleaved = "[Gloo] Rank 2" + inner + _GLOO.format(2, 3, 3)[len("[Gloo] Rank 2"):]  # as Gloo's threads write
    # piece by piece, numbers and newline split from their message (seen on the README's main job, process 1)
    pieces = ("[Gloo] Rank [Gloo] Rank 5 is connected to 74 is connected to 7 peer ranks. Expected number of connected "
              "peer ranks is :  peer ranks. Expected number of connected peer ranks is : 7\n7\n")
    gloo = _GLOO.format(0, 1, 1) + interleaved + pieces + _GLOO.format(1, 7, 7)
    r = subprocess.run([PY, "-c", _WRITER, gloo], cwd=REPO, env=launcher_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "keep 1\nkeep 2 [Gloo] not a connection line\nkeep 3\n7\nkeep 4 (no newline)"


def test_json_error_names_the_rule_once():
    with pytest.raises(requests.LineError) as e:
        requests.parse('{"id": "a\x01b", "tokens": [1]}', 4, vocab_size=10, max_tokens=10)
    assert "line 4: not valid JSON (Invalid control character at column 10)" == str(e.value)
    with pytest.raises(requests.LineError) as e:
        requests.parse('{"id": "a" "tokens": [1]}', 5, vocab_size=10, max_tokens=10)
    assert str(e.value) == "line 5: not valid JSON (Expecting ',' delimiter at column 12)"
    for line in ('{"id": "a", "text": "abc"\n', '{"id": "a", "text": "abc"\r\n', '{"id": "a", "text": "abc"'):
        with pytest.raises(requests.LineError) as e:  # a missing "}": json says line 2 column 1 when the \n is kept
            requests.parse(line, 6, vocab_size=10, max_tokens=10)
        assert str(e.value) == "line 6: not valid JSON (Expecting ',' delimiter at the end of the line)", line



def test_backend_notices_are_filtered():
    import logging

    from slope_jax import cli

    cli.quiet()
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    mxfp4, bridge = (logging.getLogger(n) for n in ("transformers.quantizers.quantizer_mxfp4", "jax._src.xla_bridge"))
    for lg in (mxfp4, bridge):
        lg.addHandler(handler)
    try:
        mxfp4.warning("MXFP4 inference on CPU requires use_kernels=True, but use_kernels is disabled. We will "
                      "dequantize the model to bf16.")
        mxfp4.warning("MXFP4 quantization is only supported on GPUs with compute capability >= 7.5. We will default "
                      "to dequantizing the model to bf16.")
        mxfp4.warning("MXFP4 checkpoint has a missing scale")  # anything else still shows
        bridge.warning("Unable to initialize backend 'tpu': no TPU here")
    finally:
        for lg in (mxfp4, bridge):
            lg.removeHandler(handler)
    assert seen == ["MXFP4 checkpoint has a missing scale"]


def test_xla_flags_set_the_device_count_and_keep_the_rest():
    """`xla_env.xla_flags` (the launcher's and convert's --cpu_devices): the virtual device count replaces an earlier
    one, the user's other flags pass through in order, and nothing is added without a count."""
    from slope_jax import xla_env

    assert xla_env.xla_flags("--xla_force_host_platform_device_count=8 --foo=1", cpu_devices=2) == \
        "--foo=1 --xla_force_host_platform_device_count=2"
    assert xla_env.xla_flags("", cpu_devices=4) == "--xla_force_host_platform_device_count=4"
    assert xla_env.xla_flags("--foo --xla_force_host_platform_device_count=8") == \
        "--foo --xla_force_host_platform_device_count=8"


def test_atomic_write_goes_through_links_and_special_files(tmp_path):
    """An output path (`--json`, `--png`, ...) that is a symbolic link replaces the file it names and keeps the
    link; a FIFO or a character device is written through: the planner's `--json` replaced a link to stdout, a FIFO,
    and, as root, /dev/full itself with a regular file. A directory is an IsADirectoryError; a regular file is still
    replaced atomically."""
    import stat
    import threading

    from slope_jax.atomic import atomic_json

    target = tmp_path / "target.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_json(str(link), {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "new.json")
    atomic_json(str(dangling), [2])
    assert dangling.is_symlink() and json.loads((tmp_path / "new.json").read_text()) == [2]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    atomic_json(str(fifo), {"b": 2})
    reader.join(10)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and json.loads(got[0]) == {"b": 2}
    atomic_json("/dev/null", {"c": 3})  # a character device: written through, never replaced
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    with pytest.raises(IsADirectoryError):
        atomic_json(str(tmp_path), {})
    atomic_json(str(target), {"d": 4})
    assert json.loads(target.read_text()) == {"d": 4} and not list(tmp_path.glob(".tmp-*"))
