"""One-device prefill benchmark of a gpt-oss-20b-shaped model cut to a few layers: tokens/s, MFU, attention vs MoE
split, peak device memory, and the Pallas-vs-XLA attention and pallas-vs-loop-vs-ragged MoE implementations side by
side, with issue 21's targets checked in the JSON (`targets`).

    PYTHONPATH=. python3 benchmarks/device_prefill.py --out /tmp/device_prefill.json      # GPU: 8K and 32K tokens
    PYTHONPATH=. python3 benchmarks/device_prefill.py --smoke --out /tmp/smoke.json       # CPU: tiny sizes, seconds
    benchmarks/device_check.sh                                                            # the same, for a GPU lease

Uses only the jax installed for the backend (no download, no network). Steps, each in its own try/except (a failure
is recorded in the JSON and the run goes on) and each skipped when the time budget (`--budget_s`) would be exceeded:
  1. bf16 matmul peak: the best of several `jnp.dot` of two n×n bf16 matrices (n = 8192), FLOPs = 2n³.
  2. the model: real dims from configs/gpt-oss-20b.json cut to `--layers` layers (sliding, full, …), random
     parameters with random MXFP4 experts generated on the device (`model.gpt_oss.init_params`; not a trained model).
  3. per length: one layer's attention (sliding and full, with its projections), the full-attention core alone
     (FLOP rate over the visible pairs, 4·N·H per pair) and one layer's MoE (FLOP rate and fraction of the peak over
     the useful FLOPs: router + k experts' three projections), each jitted alone, for every implementation
     (pallas / xla; pallas / loop / ragged): the attention-vs-MoE split and the side-by-side comparison.
  4. per length and variant (attention_impl × moe_impl): the whole single-device prefill (`model.gpt_oss.forward`),
     compiled once (compile time recorded), best of `--repeats` timed runs; tokens/s and
     MFU = analytic model FLOPs (`slope_jax.plan.flops.prefill`) / time / measured matmul peak.
Steps 3–4 run in two phases: first the first implementation of each list at every length (what `targets` needs:
prefill MFU at 8K / 32K, MoE fraction of the peak, full-attention core FLOP/s at 32K), then the comparison, so a
tight budget skips comparisons, not targets.
Peak device memory: `memory_stats()['peak_bytes_in_use']` after each step (the allocator's peak since the process
started, so it is monotone; where the backend has no allocator stats, e.g. CPU, it is null) and the compiled
program's own `memory_analysis()` (arguments + outputs + temporaries).
A watchdog writes the partial JSON and exits (status 3) if the run overruns the budget by `--grace_s`.
The JSON is rewritten (atomically) after every step, so a killed run still leaves its finished steps.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import traceback

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import best_jax_seconds, matmul_peak, start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "benchmarks/results/device_prefill.json", "JSON output path (rewritten after every step).")
flags.DEFINE_bool("smoke", False, "Tiny model, one length, one repeat, sub-steps of full layers only and two prefill "
                  "variants (CPU, the test suite): checks the script, not the device.")
flags.DEFINE_list("lengths", None, "Prompt lengths (default 8192,32768; smoke 40).")
flags.DEFINE_integer("layers", 2, "Layers of the cut model (alternating sliding, full as in gpt-oss).")
flags.DEFINE_integer("repeats", 3, "Timed runs per measurement (the best is reported).")
flags.DEFINE_float("budget_s", 270.0, "Time budget: a step that would not finish within it is skipped.")
flags.DEFINE_float("grace_s", 30.0, "The watchdog exits this long after the budget (a compile cannot be interrupted).")
flags.DEFINE_integer("matmul_n", 8192, "Size of the bf16 matmul peak measurement.")
flags.DEFINE_list("attention_impls", ["pallas", "xla"], "Attention implementations to compare (the first one is "
                  "measured first, for the targets).")
flags.DEFINE_list("moe_impls", ["pallas", "loop", "ragged"], "MoE implementations to compare (the first one is "
                  "measured first, for the targets); impl@rows sets the tile (loop@4096: 4096-row expert tiles).")
flags.DEFINE_string("config", None, "Model config JSON (default configs/gpt-oss-20b.json).")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    """Time budget, step bookkeeping and the JSON document."""

    def __init__(self, out: str, budget_s: float):
        self.t0 = time.perf_counter()
        self.out, self.budget_s = out, budget_s
        self.doc: dict = {"status": "running", "steps": {}, "failures": {}, "skipped": {}}
        self.lock = threading.Lock()
        self.load_start = start_load()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def save(self) -> None:
        with self.lock:
            self.doc["elapsed_s"] = round(self.elapsed(), 2)
            write_result(self.out, self.doc, load_start=self.load_start)

    def step(self, name: str, fn, estimate_s: float = 0.0):
        """Run `fn()` unless `estimate_s` exceeds the time left; record its result, failure or skip."""
        if estimate_s > self.left():
            log(f"skip {name}: needs ~{estimate_s:.0f} s, {self.left():.0f} s left")
            self.doc["skipped"][name] = f"needs ~{estimate_s:.0f} s, {self.left():.0f} s of the budget left"
            self.save()
            return None
        log(f"start {name}")
        t = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - record any failure and continue with the next variant
            log(f"FAILED {name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            self.doc["failures"][name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}",
                                          "traceback": traceback.format_exc()[-4000:]}
            self.save()
            return None
        wall = time.perf_counter() - t
        if isinstance(res, dict):
            res.setdefault("wall_s", round(wall, 3))
        self.doc["steps"][name] = res
        log(f"done {name} in {wall:.1f} s")
        self.save()
        return res


def _peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _program_bytes(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _timed_compiled(fn, args, repeats: int) -> dict:
    """Compile `fn` for `args` once (timed), then the best of `repeats` runs."""
    import jax

    t = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t
    best = best_jax_seconds(compiled, args, repeats)  # after one untimed run (autotuning, allocation)
    return {"compile_s": round(compile_s, 3), "seconds": best, "program_bytes": _program_bytes(compiled),
            "peak_bytes_in_use": _peak_bytes()}


def bf16_matmul_peak(n: int, repeats: int) -> dict:
    """`common.matmul_peak`: bf16 n×n×n `jnp.dot` (float32 accumulation), best of max(repeats, 5)."""
    flops_per_s = matmul_peak(n, "bfloat16", max(repeats, 5))
    return {"n": n, "seconds": 2 * n ** 3 / flops_per_s, "bf16_flops_per_s": flops_per_s}


def moe_variant(name: str) -> tuple[str, int]:
    """`--moe_impls` entry → (moe_impl, moe_tile): "loop@4096" is the loop MoE with 4096-row tiles; a bare name
    keeps StepOptions' default tile."""
    from slope_jax.model.options import StepOptions

    impl, _, tile = name.partition("@")
    return impl, int(tile) if tile else StepOptions().moe_tile


def model_config(smoke: bool, layers: int):
    from slope_jax.model.config import FULL, SLIDING, ModelConfig

    kinds = tuple(SLIDING if i % 2 == 0 else FULL for i in range(layers))
    if smoke:  # pairwise-distinct small sizes; head_dim a power of two (the Triton kernel's rule)
        return ModelConfig(num_hidden_layers=layers, num_experts=6, experts_per_token=2, vocab_size=160,
                           hidden_size=64, intermediate_size=96, num_attention_heads=12, num_key_value_heads=4,
                           head_dim=16, sliding_window=24, layer_types=kinds)
    cfg = ModelConfig.from_json(FLAGS.config or os.path.join(_REPO, "configs", "gpt-oss-20b.json"))
    return dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=kinds)


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    from slope_jax.model import attention as attn_lib
    from slope_jax.model import gpt_oss as model_lib
    from slope_jax.model import moe as moe_lib
    from slope_jax.model import rope
    from slope_jax.model.options import StepOptions
    from slope_jax.plan import flops

    smoke = FLAGS.smoke
    lengths = [int(x) for x in (FLAGS.lengths or (["40"] if smoke else ["8192", "32768"]))]
    repeats = 1 if smoke else FLAGS.repeats
    run = Run(FLAGS.out, FLAGS.budget_s)

    def watchdog():
        while run.elapsed() < FLAGS.budget_s + FLAGS.grace_s:
            time.sleep(1.0)
        log(f"watchdog: {FLAGS.budget_s + FLAGS.grace_s:.0f} s exceeded; writing the partial JSON and exiting")
        run.doc["status"] = "aborted by watchdog (a step overran the budget)"
        run.save()
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()

    dev = jax.devices()[0]
    dtype = jnp.float32 if smoke and dev.platform == "cpu" else jnp.bfloat16
    cfg = model_config(smoke, FLAGS.layers)
    run.doc.update({"jax": jax.__version__, "backend": jax.default_backend(), "device": dev.device_kind,
                    "device_count": jax.device_count(), "smoke": smoke, "dtype": jnp.dtype(dtype).name,
                    "lengths": lengths, "repeats": repeats, "budget_s": FLAGS.budget_s,
                    "config": cfg.to_dict(), "layers": cfg.num_hidden_layers,
                    "attention_impls": FLAGS.attention_impls, "moe_impls": FLAGS.moe_impls,
                    "auto": {"attention_impl": attn_lib.resolve_impl("auto"),
                             "moe_impl": moe_lib.resolve_impl("auto")}})
    log(f"jax {jax.__version__} on {dev.device_kind} ({jax.default_backend()}); model {cfg.num_hidden_layers} layers, "
        f"D={cfg.hidden_size}, E={cfg.num_experts}; lengths {lengths}; budget {FLAGS.budget_s:.0f} s")
    run.save()

    peak = run.step("matmul_peak", lambda: bf16_matmul_peak(64 if smoke else FLAGS.matmul_n, repeats))
    peak_flops = peak["bf16_flops_per_s"] if peak else None

    def init():
        p = model_lib.init_params(cfg, jax.random.key(0), dtype=jnp.dtype(dtype).name)
        jax.block_until_ready(p)
        return p

    t = time.perf_counter()
    try:
        params = init()
    except Exception as e:  # noqa: BLE001 - nothing else can run without parameters
        run.doc["failures"]["init_params"] = f"{type(e).__name__}: {e}"
        run.doc["status"] = "failed"
        run.save()
        raise
    run.doc["init_params_s"] = round(time.perf_counter() - t, 2)
    run.doc["param_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(params)))
    log(f"params: {run.doc['param_bytes'] / 2**30:.2f} GiB in {run.doc['init_params_s']} s")

    layer_p = {i: jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(min(2, cfg.num_hidden_layers))}
    sliding_i = 0
    full_i = 1 if cfg.num_hidden_layers > 1 else None

    def attention_step(impl, window):
        def f(x, p):
            t = x.shape[0]
            pos = jnp.arange(t, dtype=jnp.int32)
            cos, sin = rope.cos_sin(cfg, pos, x.dtype)
            h = model_lib.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q, k, v = model_lib.qkv(h, p, cos, sin)
            o = attn_lib.attention(q, k, v, pos, pos, p["sinks"], window=window, impl=impl, contiguous=True,
                                   windows=(window,)).astype(x.dtype)
            return x + model_lib.project(o, p["wo"]).astype(x.dtype)
        return f

    def moe_step(impl):
        impl, tile = moe_variant(impl)

        def f(x, p):
            h = model_lib.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            valid = jnp.ones((x.shape[0],), bool)
            y = moe_lib.moe(h, valid, p, experts_per_token=cfg.experts_per_token, alpha=cfg.swiglu_alpha,
                            limit=cfg.swiglu_limit, impl=impl, tile=tile)
            return x + y.astype(x.dtype)
        return f

    def forward_fn(a_impl, m_impl):
        m_impl, tile = moe_variant(m_impl)

        def f(params, tokens, n):
            logits, k, v = model_lib.forward(params, cfg, tokens, n,
                                             StepOptions(attention_impl=a_impl, moe_impl=m_impl, moe_tile=tile))
            return logits, k, v
        return f

    cost: dict[str, float] = {}  # measured wall time of a step at the previous length, for the skip estimate

    def estimate(kind: str, t_len: int, prev_len: int | None) -> float:
        if prev_len is None or kind not in cost:
            return 10.0 if smoke else 25.0
        return cost[kind] * max(1.0, (t_len / prev_len) ** 1.5)

    def record(kind, res):
        if res:
            cost[kind] = res["wall_s"]

    a0, m0 = FLAGS.attention_impls[0], FLAGS.moe_impls[0]
    variants = [(a0, m0)] + [(a, m) for a in FLAGS.attention_impls for m in FLAGS.moe_impls if (a, m) != (a0, m0)]
    variants.sort(key=lambda v: (v != (a0, m0), v != (FLAGS.attention_impls[-1], FLAGS.moe_impls[-1])))
    if smoke:  # the fastest and the reference variant only
        variants = variants[:2]
    data: dict[int, tuple] = {}

    def inputs(t_len):
        if t_len not in data:
            x = (jax.random.normal(jax.random.key(t_len), (t_len, cfg.hidden_size), jnp.float32) * 0.5).astype(dtype)
            tokens = jax.random.randint(jax.random.key(t_len + 1), (t_len,), 0, cfg.vocab_size, jnp.int32)
            ks = jax.random.split(jax.random.key(t_len + 2), 3)
            n_h, n_kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            qkv = tuple(jax.random.normal(kk, (t_len, heads, hd), dtype)
                        for kk, heads in zip(ks, (n_h, n_kv, n_kv)))
            data[t_len] = (x, tokens, jnp.int32(t_len), qkv)
        return data[t_len]

    def core_attention(impl):
        def f(q, k, v, sinks):
            pos = jnp.arange(q.shape[0], dtype=jnp.int32)
            return attn_lib.attention(q, k, v, pos, pos, sinks, impl=impl, contiguous=True,
                                      windows=(attn_lib.NO_WINDOW,))
        return f

    subs: dict[int, dict] = {t: {} for t in lengths}
    prev_of = {t: (lengths[i - 1] if i else None) for i, t in enumerate(lengths)}
    # phase 1 measures what the targets need (the first implementation of each list at every length: one layer's
    # attention and MoE, the attention core alone, the whole prefill); phase 2 the side-by-side comparison
    phases = [([a0], [m0], variants[:1]), (FLAGS.attention_impls[1:], FLAGS.moe_impls[1:], variants[1:])]
    for a_impls, m_impls, phase_variants in phases:
        for t_len in lengths:
            prev = prev_of[t_len]
            x, tokens, n, qkv = inputs(t_len)
            # 3. sub-steps: one layer's attention (sliding, full) and one layer's MoE, per implementation
            for impl in a_impls:
                for kind, li, window in (("sliding", sliding_i, cfg.sliding_window),
                                         ("full", full_i, attn_lib.NO_WINDOW)):
                    if li is None or (smoke and kind == "sliding"):
                        continue
                    name = f"T{t_len}/attention_{kind}/{impl}"
                    res = run.step(name, lambda impl=impl, li=li, window=window: _timed_compiled(
                        attention_step(impl, window), (x, layer_p[li]), repeats), estimate(name[name.index("/"):],
                                                                                         t_len, prev))
                    record(name[name.index("/"):], res)
                    subs[t_len][f"attention_{kind}/{impl}"] = res
                if smoke and impl != a0:  # smoke runs: the script path once is enough (interpret mode is slow)
                    continue
                # the full-attention core alone (no projections): the kernel's FLOP rate, FLOPs over visible pairs
                name = f"T{t_len}/attention_core_full/{impl}"
                core_flops = 4.0 * cfg.num_attention_heads * cfg.head_dim * flops.visible_pairs(t_len, None)

                def core(impl=impl, core_flops=core_flops, qkv=qkv):
                    r = _timed_compiled(core_attention(impl), (*qkv, layer_p[0]["sinks"]), repeats)
                    r.update({"attention_flops": core_flops, "flops_per_s": core_flops / r["seconds"]})
                    return r

                record(name[name.index("/"):], run.step(name, core, estimate(name[name.index("/"):], t_len, prev)))
            for impl in m_impls:
                name = f"T{t_len}/moe/{impl}"
                # useful FLOPs of one layer's MoE: router + the k selected experts' three projections per token
                moe_flops = float(t_len * (2 * cfg.hidden_size * cfg.num_experts + cfg.experts_per_token
                                           * 6 * cfg.hidden_size * cfg.intermediate_size))

                def moe_run(impl=impl, moe_flops=moe_flops, x=x):
                    r = _timed_compiled(moe_step(impl), (x, layer_p[0]), repeats)
                    r.update({"moe_flops": moe_flops, "flops_per_s": moe_flops / r["seconds"]})
                    if peak_flops:
                        r["fraction_of_peak"] = r["flops_per_s"] / peak_flops
                    return r

                res = run.step(name, moe_run, estimate(name[name.index("/"):], t_len, prev))
                record(name[name.index("/"):], res)
                subs[t_len][f"moe/{impl}"] = res
            # 4. the whole prefill
            f_model = flops.prefill(cfg, t_len)
            for a_impl, m_impl in phase_variants:
                name = f"T{t_len}/prefill/{a_impl}+{m_impl}"
                key = name[name.index("/"):]

                def full(a_impl=a_impl, m_impl=m_impl, tokens=tokens, n=n, f_model=f_model, t_len=t_len):
                    r = _timed_compiled(forward_fn(a_impl, m_impl), (params, tokens, n), repeats)
                    r.update({"tokens": t_len, "tokens_per_s": t_len / r["seconds"], "model_flops": f_model["total"],
                              "attention_flops": f_model["attention"],
                              "achieved_flops_per_s": f_model["total"] / r["seconds"]})
                    if peak_flops:
                        r["mfu"] = r["achieved_flops_per_s"] / peak_flops
                    return r

                record(key, run.step(name, full, estimate(key, t_len, prev)))
    for t_len in lengths:
        # attention vs MoE split from the sub-steps (per layer pair: one sliding + one full attention, two MoE)
        split = {}
        for a_impl in FLAGS.attention_impls:
            for m_impl in FLAGS.moe_impls:
                s_ = subs[t_len].get(f"attention_sliding/{a_impl}")
                f_ = subs[t_len].get(f"attention_full/{a_impl}")
                m_ = subs[t_len].get(f"moe/{m_impl}")
                if smoke and f_ and m_:  # no sliding sub-step in smoke runs: count the full layer twice
                    s_ = f_
                if s_ and m_ and (f_ or full_i is None):
                    att = s_["seconds"] + (f_["seconds"] if f_ else 0.0)
                    moe_s = m_["seconds"] * (2 if f_ else 1)
                    split[f"{a_impl}+{m_impl}"] = {"attention_s": att, "moe_s": moe_s,
                                                   "attention_share": att / (att + moe_s)}
        run.doc.setdefault("split", {})[str(t_len)] = split
    run.doc["targets"] = targets(run.doc["steps"], lengths, a0, m0)
    run.save()

    run.doc["peak_bytes_in_use"] = _peak_bytes()
    run.doc["status"] = "done" if not run.doc["failures"] else "done with failures"
    run.save()
    _print_table(run.doc)
    log(f"wrote {run.out} ({run.doc['status']}, {run.elapsed():.0f} s)")


# issue 21's bar for one H200 (20b dims, 2 layers): prefill MFU at 8K / 32K, one MoE layer's share of the measured
# bf16 peak, the full-attention core's FLOP rate at 32K
TARGETS = {"prefill_mfu": {8192: 0.35, 32768: 0.40}, "moe_fraction_of_peak": 0.45,
           "attention_core_full_flops_per_s": {32768: 350e12}}


def targets(steps: dict, lengths: list[int], a_impl: str, m_impl: str) -> list[dict]:
    """Each measured target: {name, value, threshold (None where the issue sets none), met}."""
    out = []

    def add(name, value, threshold):
        out.append({"name": name, "value": value, "threshold": threshold,
                    "met": None if threshold is None or value is None else value >= threshold})

    for t in lengths:
        pre = steps.get(f"T{t}/prefill/{a_impl}+{m_impl}") or {}
        add(f"T{t}/prefill/{a_impl}+{m_impl}/mfu", pre.get("mfu"), TARGETS["prefill_mfu"].get(t))
        m = steps.get(f"T{t}/moe/{m_impl}") or {}
        add(f"T{t}/moe/{m_impl}/fraction_of_peak", m.get("fraction_of_peak"), TARGETS["moe_fraction_of_peak"])
        c = steps.get(f"T{t}/attention_core_full/{a_impl}") or {}
        add(f"T{t}/attention_core_full/{a_impl}/flops_per_s", c.get("flops_per_s"),
            TARGETS["attention_core_full_flops_per_s"].get(t))
    return out


def _print_table(doc: dict) -> None:
    steps = doc["steps"]
    peak = steps.get("matmul_peak")
    if peak:
        print(f"\nbf16 matmul peak ({peak['n']}^3): {peak['bf16_flops_per_s'] / 1e12:.1f} TFLOP/s")
    print(f"\n{'step':<40} {'compile s':>9} {'time ms':>10} {'tok/s':>10} {'MFU':>7} {'prog GiB':>9}")
    for name, r in steps.items():
        if name == "matmul_peak" or not isinstance(r, dict) or "seconds" not in r:
            continue
        tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else ""
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else ""
        pb = f"{r['program_bytes'] / 2**30:.2f}" if r.get("program_bytes") else ""
        print(f"{name:<40} {r['compile_s']:>9.1f} {r['seconds'] * 1e3:>10.2f} {tps:>10} {mfu:>7} {pb:>9}")
    for t_len, split in doc.get("split", {}).items():
        for v, s in split.items():
            print(f"T={t_len} {v}: attention {s['attention_s'] * 1e3:.1f} ms vs MoE {s['moe_s'] * 1e3:.1f} ms per "
                  f"layer pair ({s['attention_share']:.0%} attention)")
    for tg in doc.get("targets", []):
        v, th = tg["value"], tg["threshold"]
        fmt = (lambda x: f"{x / 1e12:.0f} TFLOP/s") if "flops_per_s" in tg["name"] else (lambda x: f"{x:.1%}")
        print(f"target {tg['name']}: {fmt(v) if v is not None else 'not measured'}"
              + (f" (bar {fmt(th)}: {'met' if tg['met'] else 'NOT met'})" if th is not None and v is not None else ""))
    if doc.get("peak_bytes_in_use"):
        print(f"peak device memory in use: {doc['peak_bytes_in_use'] / 2**30:.2f} GiB")
    for name, why in doc["skipped"].items():
        print(f"skipped {name}: {why}")
    for name, f in doc["failures"].items():
        print(f"FAILED {name}: {(f['error'] if isinstance(f, dict) else f).splitlines()[0][:200]}")


if __name__ == "__main__":
    app.run(main)
