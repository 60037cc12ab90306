"""The parts of benchmarks/rocm_check.sh that are not scripts of their own, and the step that merges every part's JSON
into the one `rocm_check.json` a user sends back. Subcommands:

    prefill_parity --out=F [--smoke]    a small float32 prefill on JAX's default device (the engine's resolved
                                        kernels) vs the same prefill on the CPU (XLA attention, loop MoE)
    memory --out=F [--prefill=F] [--hardware=mi250]
                                        the device allocator's stats, the prefill benchmark's peak, and the planner's
                                        predicted memory and headroom for the prefill benchmark's config and lengths
    merge --dir=D [--dry_run]           the parts' JSON (D/<part>.json) and exit statuses (D/parts.tsv)
                                        → D/rocm_check.json

`SCHEMA` lists every field of rocm_check.json with its type and unit (docs/deployment.md prints the same table;
tests/test_rocm_check.py checks that both agree and that a merged document has every field); `check_schema(doc)`
returns the fields that are missing or mistyped. A part that failed (no JSON, or a JSON without its fields) is
{"error": "...", "log_tail": "..."} in place of its object, and the merge still writes the document.
Imports only the standard library at module level; `merge` never imports JAX (it runs even where JAX is broken).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

SCHEMA_VERSION = 1
PARTS = ("kernel_parity", "prefill_parity", "device_prefill", "collective_bw", "memory")
# the environment variables recorded in `env` (set by launch/rocm_env.sh or the user): exact names and prefixes
ENV_NAMES = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE",
             "JAX_PLATFORMS", "SLOPE_HARDWARE", "GPU_MAX_HW_QUEUES")
ENV_PREFIXES = ("HIP_", "ROCR_", "HSA_", "NCCL_", "RCCL_", "MIOPEN_", "TF_ROCM_", "AMD_", "HIPBLASLT_")

# (path, type, unit, meaning): "*" is any key; "T" a prompt length ("8192"); type "a|b" allows either
SCHEMA = (
    ("schema_version", "int", "", "1; bumped when a field changes meaning"),
    ("dry_run", "bool", "", "true: `--dry-run` on the CPU (checks the script, not the device)"),
    ("ok", "bool", "", "every part exited 0, both parity checks within tolerance"),
    ("device.backend", "str", "", "JAX backend of the parts (`rocm`; `cpu` in a dry run)"),
    ("device.kind", "str", "", "`device_kind` of device 0 (e.g. `AMD Instinct MI250X`)"),
    ("device.count", "int", "devices", "local devices JAX sees (GCDs: 8 on a 4-card MI250 host)"),
    ("device.rocm_version", "str|null", "", "/opt/rocm/.info/version, null if absent"),
    ("parts.*.exit_status", "int", "", "the part's exit status (124/137: its timeout)"),
    ("parts.*.seconds", "int", "s", "the part's wall time"),
    ("parity.kernels.ok", "bool", "", "every float32 kernel case within `tol_f32`, finite, masks identical"),
    ("parity.kernels.tol_f32", "number", "", "float32 tolerance (attention: max abs diff; MoE: relative to "
     "max(1, |ref|))"),
    ("parity.kernels.max_diff_f32", "number|null", "", "the worst float32 case's difference"),
    ("parity.kernels.failed", "list", "", "cases over tolerance or failing"),
    ("parity.kernels.skipped", "list", "", "cases not started (time budget)"),
    ("parity.kernels.cases", "object", "", "benchmarks/kernel_parity.py's rows, `part/case/dtype` → row"),
    ("parity.prefill_vs_cpu.ok", "bool", "", "`logits_max_abs_diff / logits_scale` and `kv_max_abs_diff` ≤ `tol`, "
     "same argmax"),
    ("parity.prefill_vs_cpu.tol", "number", "", "the tolerance (float32, matmul precision \"highest\")"),
    ("parity.prefill_vs_cpu.logits_max_abs_diff", "number", "logits", "max |device − CPU| over the last token's "
     "logits"),
    ("parity.prefill_vs_cpu.logits_scale", "number", "logits", "max(1, max |CPU logits|)"),
    ("parity.prefill_vs_cpu.kv_max_abs_diff", "number", "", "max |device − CPU| over every layer's K and V"),
    ("parity.prefill_vs_cpu.argmax_equal", "bool", "", "the same next token"),
    ("parity.prefill_vs_cpu.tokens", "int", "tokens", "prompt length of the check"),
    ("parity.prefill_vs_cpu.impls", "object", "", "`attention_impl`, `moe_impl` on the device (the engine's \"auto\")"),
    ("prefill.status", "str", "", "`done`, `done with failures`, or why it stopped"),
    ("prefill.dtype", "str", "", "activation dtype (bfloat16; float32 in a dry run)"),
    ("prefill.layers", "int", "", "layers of the gpt-oss-20b-shaped cut"),
    ("prefill.lengths", "list", "tokens", "prompt lengths measured (8192, 32768)"),
    ("prefill.impls", "object", "", "`attention`, `moe`: the implementation the MFU figures use"),
    ("prefill.matmul_peak_flops_per_s", "number|null", "FLOP/s", "same-run bf16 matmul peak (8192³)"),
    ("prefill.mfu.T", "number|null", "fraction", "model FLOPs / time / matmul peak, per length"),
    ("prefill.mfu_by_variant", "object", "", "`attention+moe` → {T: MFU}: every implementation pair measured"),
    ("prefill.tokens_per_s.T", "number|null", "tokens/s", "prefill throughput, per length"),
    ("prefill.attention_core_flops_per_s.T", "number|null", "FLOP/s", "full-attention core alone, per length"),
    ("prefill.peak_bytes_in_use", "int|null", "bytes", "allocator peak over the benchmark (null without stats)"),
    ("prefill.failures", "list", "", "steps that failed"),
    ("prefill.targets", "list", "", "issue 21's bars: {name, value, threshold, met}"),
    ("collectives.device_count", "int", "devices", "size of the 1-D mesh"),
    ("collectives.single_device", "bool", "", "one device: the collectives are copies"),
    ("collectives.results.*", "list", "", "per op (all_to_all, ppermute, all_gather, psum): {bytes, seconds, "
     "algbw_GBps, busbw_GBps} per message size"),
    ("collectives.busbw_GBps.*", "number|null", "GB/s", "per op, bus bandwidth at the largest size measured"),
    ("memory.hardware", "str", "", "planner profile (`SLOPE_HARDWARE`, default mi250)"),
    ("memory.bytes_limit", "int|null", "bytes", "allocator limit of device 0 (`memory_stats()`; null on CPU)"),
    ("memory.bytes_in_use", "int|null", "bytes", "in use at the probe (a fresh process: the runtime's own)"),
    ("memory.prefill_peak_bytes_in_use", "int|null", "bytes", "`prefill.peak_bytes_in_use`"),
    ("memory.measured_headroom_bytes", "int|null", "bytes", "bytes_limit − prefill_peak_bytes_in_use"),
    ("memory.planned_usable_bytes", "number", "bytes", "profile: HBM × memory_fraction − runtime reserve"),
    ("memory.profile_pool_bytes", "number", "bytes", "profile: HBM × memory_fraction (compare with bytes_limit)"),
    ("memory.predicted", "list", "", "per length: {length, memory_bytes_per_device, headroom_bytes, fits_memory} "
     "from `plan.predict` for the prefill's config on one device"),
    ("env", "object", "", "the ROCm/XLA/RCCL variables that were set (`HIP_*`, `HSA_*`, `NCCL_*`, `XLA_*`, …)"),
    ("provenance", "object", "", "commit, date, versions, machine, load, argv (benchmarks/common.py)"),
)
_TYPES = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool), "bool": lambda v: isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "str": lambda v: isinstance(v, str),
          "list": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict), "null": lambda v: v is None}


def _values(doc, parts: list[str]):
    """Every (path, value) under `doc` matching the path `parts` ("*" and "T" match any key); a missing key gives
    (path, KeyError)."""
    if not parts:
        yield "", doc
        return
    head, rest = parts[0], parts[1:]
    if not isinstance(doc, dict):
        yield head, KeyError(head)
        return
    keys = list(doc) if head in ("*", "T") else [head]
    for k in keys:
        if k not in doc:
            yield k, KeyError(k)
            continue
        for p, v in _values(doc[k], rest):
            yield (f"{k}.{p}" if p else k), v


def check_schema(doc: dict) -> list[str]:
    """The problems of `doc` against SCHEMA: missing or mistyped fields. A top-level part (parity.kernels,
    prefill, …) that is {"error": ...} counts as present, its fields not required."""
    problems = []
    for path, typ, _unit, _ in SCHEMA:
        parts = path.split(".")
        errored = any(isinstance(_get(doc, parts[:i]), dict) and "error" in _get(doc, parts[:i])
                      for i in range(1, len(parts)))
        if errored:
            continue
        for p, v in _values(doc, parts):
            if isinstance(v, KeyError):
                problems.append(f"{path}: missing ({p})")
            elif not any(_TYPES[t](v) for t in typ.split("|")):
                problems.append(f"{p}: {type(v).__name__} {str(v)[:60]!r} is not {typ}")
    return problems


def _get(doc, parts):
    for p in parts:
        if not isinstance(doc, dict) or p not in doc:
            return None
        doc = doc[p]
    return doc


# --- part: prefill parity vs the CPU ----------------------------------------------------------------------------------

def parity_config(smoke: bool):
    """The model of the prefill parity check: tiny in a dry run, else 4 layers with head_dim 64 (the Triton kernel's
    tile) and a 128-token window that a 640-token prompt crosses. Pairwise-distinct sizes."""
    from slope_jax.model.config import FULL, SLIDING, ModelConfig

    if smoke:
        return ModelConfig(num_hidden_layers=2, num_experts=6, experts_per_token=2, vocab_size=160, hidden_size=64,
                           intermediate_size=96, num_attention_heads=12, num_key_value_heads=4, head_dim=16,
                           sliding_window=24, layer_types=(SLIDING, FULL)), 40, 37
    return ModelConfig(num_hidden_layers=4, num_experts=8, experts_per_token=2, vocab_size=1000, hidden_size=512,
                       intermediate_size=384, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                       sliding_window=128, layer_types=(SLIDING, FULL) * 2), 640, 601


def prefill_parity(out: str, smoke: bool, tol: float) -> int:
    """Write the prefill-vs-CPU parity JSON to `out`; exit status 1 if over `tol`."""
    load0 = start_load()
    if os.environ.get("JAX_PLATFORMS") and "cpu" not in os.environ["JAX_PLATFORMS"].split(","):
        os.environ["JAX_PLATFORMS"] += ",cpu"  # the CPU reference needs the CPU backend beside the device's
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.model import gpt_oss
    from slope_jax.model.options import StepOptions

    jax.config.update("jax_default_matmul_precision", "highest")
    cfg, t, n = parity_config(smoke)
    dev, cpu = jax.devices()[0], jax.devices("cpu")[0]
    device_opts = StepOptions().resolve()  # "auto" for the default backend, as the engine resolves it
    params = gpt_oss.init_params(cfg, jax.random.key(0), dtype="float32")
    tokens = jax.random.randint(jax.random.key(1), (t,), 0, cfg.vocab_size, jnp.int32)

    def run(options, device):
        p, tok = jax.device_put((params, tokens), device)
        f = jax.jit(lambda p, tok, m: gpt_oss.forward(p, cfg, tok, m, options))
        return [np.asarray(a) for a in f(p, tok, jax.device_put(jnp.int32(n), device))]

    t0 = time.perf_counter()
    logits_d, k_d, v_d = run(device_opts, dev)
    logits_c, k_c, v_c = run(StepOptions(attention_impl="xla", moe_impl="loop").resolve(), cpu)
    scale = max(1.0, float(np.abs(logits_c).max()))
    diff = float(np.abs(logits_d - logits_c).max())
    kv = max(float(np.abs(k_d[:, :n] - k_c[:, :n]).max()), float(np.abs(v_d[:, :n] - v_c[:, :n]).max()))
    argmax = bool(int(logits_d.argmax()) == int(logits_c.argmax()))
    finite = bool(np.isfinite(logits_d).all())
    doc = {"backend": jax.default_backend(), "device": dev.device_kind, "tokens": t, "real_tokens": n,
           "layers": cfg.num_hidden_layers, "config": cfg.to_dict(), "tol": tol,
           "impls": {"attention_impl": device_opts.attention_impl, "moe_impl": device_opts.moe_impl},
           "logits_max_abs_diff": diff, "logits_scale": scale, "kv_max_abs_diff": kv, "argmax_equal": argmax,
           "finite": finite, "seconds": round(time.perf_counter() - t0, 2)}
    doc["ok"] = finite and argmax and diff / scale <= tol and kv <= tol
    write_result(out, doc, load_start=load0)
    print(f"prefill {t} tokens on {dev.device_kind} ({device_opts.attention_impl}+{device_opts.moe_impl}) vs CPU: "
          f"max|Δlogits| {diff:.2e} (scale {scale:.2f}), max|ΔKV| {kv:.2e}, argmax equal {argmax}: "
          f"{'ok' if doc['ok'] else 'OVER TOLERANCE'} (tol {tol:g})", flush=True)
    return 0 if doc["ok"] else 1


# --- part: memory -------------------------------------------------------------------------------------------------

def _prefill_model(prefill: dict | None):
    """(config, lengths, dtype) of the prefill benchmark's JSON, or gpt-oss-20b cut to 2 layers at 8K/32K bf16."""
    import dataclasses

    from slope_jax.model.config import FULL, SLIDING, ModelConfig

    if prefill and isinstance(prefill.get("config"), dict):
        c = dict(prefill["config"])
        c.update(layer_types=tuple(c["layer_types"]), eos_token_ids=tuple(c.get("eos_token_ids", ())))
        return ModelConfig(**c), list(prefill["lengths"]), prefill.get("dtype", "bfloat16")
    cfg = ModelConfig.from_json(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                             "configs", "gpt-oss-20b.json"))
    return dataclasses.replace(cfg, num_hidden_layers=2, layer_types=(SLIDING, FULL)), [8192, 32768], "bfloat16"


def memory(out: str, prefill_path: str | None, hardware: str) -> int:
    """Write the memory-headroom JSON to `out` (the fields: SCHEMA's `memory.*`)."""
    load0 = start_load()
    import jax

    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.plan import hardware as hw_lib
    from slope_jax.plan import model as plan_model

    prefill = _read(prefill_path) if prefill_path else None
    stats = jax.local_devices()[0].memory_stats() or {}
    cfg, lengths, dtype = _prefill_model(prefill)
    hw = hw_lib.load(hardware)
    predicted = []
    for t in lengths:
        p = plan_model.predict(cfg, ParallelConfig(), t, hw, dtype=dtype, devices_per_host=1)
        predicted.append({"length": t, "memory_bytes_per_device": p.memory_bytes_per_device,
                          "headroom_bytes": p.headroom_bytes, "fits_memory": p.fits_memory,
                          "memory_breakdown": p.memory_breakdown})
    peak = _prefill_peak(prefill)
    limit = stats.get("bytes_limit")
    doc = {"hardware": hw.name, "backend": jax.default_backend(), "device": jax.local_devices()[0].device_kind,
           "bytes_limit": limit, "bytes_in_use": stats.get("bytes_in_use"),
           "prefill_peak_bytes_in_use": peak,
           "measured_headroom_bytes": limit - peak if limit is not None and peak is not None else None,
           "planned_usable_bytes": hw.usable_bytes, "profile_pool_bytes": hw.hbm_bytes * hw.memory_fraction,
           "runtime_reserve_gib": hw.runtime_reserve_gib, "predicted": predicted, "memory_stats": stats}
    write_result(out, doc, load_start=load0)
    gib = 2**30
    print(f"memory: limit {limit / gib if limit else float('nan'):.2f} GiB, prefill peak "
          f"{peak / gib if peak else float('nan'):.2f} GiB; planner ({hw.name}) usable "
          f"{hw.usable_bytes / gib:.2f} GiB, "
          + ", ".join(f"{r['length']}: predicted {r['memory_bytes_per_device'] / gib:.2f} GiB" for r in predicted),
          flush=True)
    return 0


def _prefill_peak(prefill: dict | None) -> int | None:
    """The largest `peak_bytes_in_use` the prefill benchmark recorded (its steps and its end), or None."""
    if not prefill:
        return None
    seen = [prefill.get("peak_bytes_in_use")] + [s.get("peak_bytes_in_use") for s in prefill.get("steps", {}).values()
                                                 if isinstance(s, dict)]
    seen = [int(v) for v in seen if isinstance(v, (int, float))]
    return max(seen) if seen else None


# --- merge --------------------------------------------------------------------------------------------------------

def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError):
        return None


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def _error(d: str, name: str, status: dict, why: str) -> dict:
    st = status.get(name)
    ran = f"exit status {st['exit_status']} after {st['seconds']} s" if st else "did not run"
    return {"error": f"{name}: {why} ({ran})", "log_tail": _tail(os.path.join(d, f"{name}.log"))}


def _kernels(doc: dict) -> dict:
    f32 = [r.get("max_abs_diff", r.get("max_abs_diff_over_scale")) for k, r in doc["cases"].items()
           if k.endswith("/float32") and isinstance(r, dict)]
    f32 = [v for v in f32 if isinstance(v, (int, float))]
    ring = [r["ring_continuation_max_abs_diff"] for k, r in doc["cases"].items()
            if k.endswith("/float32") and isinstance(r, dict) and "ring_continuation_max_abs_diff" in r]
    failed = [k for k, r in doc["cases"].items() if "error" in r or not r.get("finite", True)
              or (k.endswith("/float32") and max(r.get("max_abs_diff", r.get("max_abs_diff_over_scale", 0)),
                                                 r.get("ring_continuation_max_abs_diff", 0)) > doc["tol_f32"])]
    return {"ok": bool(doc["ok"]), "tol_f32": doc["tol_f32"], "max_diff_f32": max(f32 + ring) if f32 else None,
            "failed": failed, "skipped": list(doc.get("skipped", [])), "cases": doc["cases"]}


def _prefill(doc: dict) -> dict:
    a, m = doc["attention_impls"][0], doc["moe_impls"][0]
    steps = doc.get("steps", {})

    def per_length(kind, field):
        return {str(t): (steps.get(f"T{t}/{kind}") or {}).get(field) for t in doc["lengths"]}

    peak = steps.get("matmul_peak") or {}
    return {"status": doc.get("status", "?"), "dtype": doc["dtype"], "layers": doc["layers"],
            "lengths": doc["lengths"], "impls": {"attention": a, "moe": m},
            "matmul_peak_flops_per_s": peak.get("bf16_flops_per_s"),
            "mfu": per_length(f"prefill/{a}+{m}", "mfu"),
            "tokens_per_s": per_length(f"prefill/{a}+{m}", "tokens_per_s"),
            "attention_core_flops_per_s": per_length(f"attention_core_full/{a}", "flops_per_s"),
            "mfu_by_variant": _by_variant(steps, "mfu"), "peak_bytes_in_use": _prefill_peak(doc),
            "failures": sorted(doc.get("failures", {})),
            "targets": doc.get("targets", []), "skipped": doc.get("skipped", {})}


def _by_variant(steps: dict, field: str) -> dict:
    """{attention+moe: {T: steps["T<T>/prefill/<variant>"][field]}} over every prefill step measured."""
    out: dict = {}
    for name, r in steps.items():
        parts = name.split("/")
        if len(parts) == 3 and parts[1] == "prefill" and isinstance(r, dict):
            out.setdefault(parts[2], {})[parts[0][1:]] = r.get(field)
    return out


def _collectives(doc: dict) -> dict:
    busbw = {op: (rows[-1]["busbw_GBps"] if rows else None) for op, rows in doc["results"].items()}
    return {"device_count": doc["device_count"], "single_device": doc["single_device"], "results": doc["results"],
            "busbw_GBps": busbw, "failures": doc.get("failures", {}), "smoke": doc.get("smoke", False)}


def _part(d: str, name: str, status: dict, summarise) -> tuple[dict, dict | None]:
    """(the part's summary or its error object, its raw JSON or None)."""
    raw = _read(os.path.join(d, f"{name}.json"))
    if raw is None:
        return _error(d, name, status, "no JSON written"), None
    try:
        return summarise(raw), raw
    except (KeyError, TypeError, ValueError, IndexError) as e:
        return _error(d, name, status, f"JSON without the expected fields ({type(e).__name__}: {e})"), raw


def _status(d: str) -> dict:
    """{part: {exit_status, seconds}} from D/parts.tsv (lines `name<TAB>status<TAB>seconds`)."""
    out = {}
    try:
        with open(os.path.join(d, "parts.tsv")) as f:
            for line in f:
                cols = line.split()
                if len(cols) == 3:
                    out[cols[0]] = {"exit_status": int(cols[1]), "seconds": int(cols[2]), "log": f"{cols[0]}.log"}
    except (OSError, ValueError):
        pass
    return out


def merge(d: str, dry_run: bool) -> dict:
    """Merge the parts in directory `d` into `d/rocm_check.json` (SCHEMA). Returns the document written."""
    status = _status(d)
    kernels, kp = _part(d, "kernel_parity", status, _kernels)
    pp_raw = _read(os.path.join(d, "prefill_parity.json"))
    pp = ({k: pp_raw[k] for k in ("ok", "tol", "logits_max_abs_diff", "logits_scale", "kv_max_abs_diff",
                                  "argmax_equal", "tokens", "impls", "finite")}
          if pp_raw and "ok" in pp_raw else _error(d, "prefill_parity", status, "no JSON written"))
    prefill, dp = _part(d, "device_prefill", status, _prefill)
    coll, cb = _part(d, "collective_bw", status, _collectives)
    mem, mm = _part(d, "memory", status, lambda m: {k: m[k] for k in (
        "hardware", "bytes_limit", "bytes_in_use", "prefill_peak_bytes_in_use", "measured_headroom_bytes",
        "planned_usable_bytes", "profile_pool_bytes", "runtime_reserve_gib", "predicted")})
    raws = [r for r in (mm, cb, dp, kp, pp_raw) if r]
    machine = next((r["provenance"]["machine"] for r in raws if "jax_backend" in r.get("provenance", {}).get(
        "machine", {})), {})
    rocm = _tail("/opt/rocm/.info/version", 200).strip() or None
    env = {k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    doc = {"schema_version": SCHEMA_VERSION, "dry_run": dry_run,
           "device": {"backend": next((r["backend"] for r in raws if "backend" in r), machine.get("jax_backend", "?")),
                      "kind": next((r["device"] for r in raws if "device" in r), "?"),
                      "count": machine.get("device_count", 0), "rocm_version": rocm},
           "parts": status, "parity": {"kernels": kernels, "prefill_vs_cpu": pp}, "prefill": prefill,
           "collectives": coll, "memory": mem, "env": env}
    doc["ok"] = (all(s["exit_status"] == 0 for s in status.values()) and set(status) >= set(PARTS)
                 and all("error" not in p for p in (kernels, pp, prefill, coll, mem))
                 and kernels.get("ok") is True and pp.get("ok") is True)
    return write_result(os.path.join(d, "rocm_check.json"), doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prefill_parity")
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--tol", type=float, default=1e-3, help="max |Δlogits| / max(1, max |logits|) and max |ΔKV|")
    m = sub.add_parser("memory")
    m.add_argument("--out", required=True)
    m.add_argument("--prefill", default=None, help="device_prefill.py's JSON (config, lengths, peak)")
    m.add_argument("--hardware", default=os.environ.get("SLOPE_HARDWARE", "mi250"))
    g = sub.add_parser("merge")
    g.add_argument("--dir", required=True)
    g.add_argument("--dry_run", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "prefill_parity":
        return prefill_parity(a.out, a.smoke, a.tol)
    if a.cmd == "memory":
        return memory(a.out, a.prefill, a.hardware)
    doc = merge(a.dir, a.dry_run)
    problems = check_schema(doc)
    print(f"rocm_check.json: {'ok' if doc['ok'] else 'NOT ok'}; {len(problems)} schema problems"
          + "".join(f"\n  {p}" for p in problems), flush=True)
    return 0 if not problems else 2


if __name__ == "__main__":
    sys.exit(main())
