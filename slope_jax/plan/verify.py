"""Check the cost model against what XLA compiles: FLOPs per device, collective bytes per device and
argument + temporary memory per device, for one engine layout and prompt length. Imports JAX (inside functions):
used by tests/test_plan.py and benchmarks/plan_vs_xla.py, never by the planner itself.

XLA side: dot FLOPs of the compiled HLO with the `known_trip_count` of every enclosing loop applied
(`hlo.matmul_flops`). Loops whose trip count is data-dependent (the attention key-tile range, MoE tiles per expert)
contribute their per-pass FLOPs × the model's trip count for that loop class (the model's FLOPs over its one-pass
FLOPs): their per-iteration shapes are XLA's, their trip counts the model's, and `attention_work` checks those
against the compiled program's own count (`attention.count_work`). Collectives: `traffic.hlo_bytes_by_scope`.
Memory: `compiled.memory_analysis()` argument + temp bytes. Under expert parallelism (the engine's default when R·U
divides the expert count) every count uses the engine's EP degree; the EP collectives are counted as the HLO counts
them (`moe_traffic.MoeTraffic.block_total`: all-to-all by its operand, one round; all-gather and reduce-scatter by
their per-device block).
"""

from __future__ import annotations

import re

from slope_jax.plan import flops, hlo, memory, moe_traffic, traffic


def _loop_class(op_name: str) -> str:
    if "/moe/" in op_name:  # one loop per height of the expert loop's ladder (`model.moe.experts`: "tiles<h>")
        height = re.search(r"/tiles(\d+)/", op_name)
        return f"moe_{height.group(1)}" if height else "moe"
    if "sliding_layer/" in op_name:
        return "sliding"
    if "ring_step0" in op_name:
        return "step0"
    if "ring_step" in op_name:
        return "ring"
    return "attention"  # the single-device layer scan: sliding and full layers share one loop


def compare(engine, n: int, m: int | None = None, t: int | None = None) -> dict:
    """Model vs compiled program for `engine` (a PrefillEngine) at an n-token prompt, `m` requests per step
    (default the layout's in-flight count), compiled at length `t` (default the engine's bucket; any t >= n on one
    device, else a multiple of `parallel.token_multiple`). Returns a JSON-ready row with both sides and their ratios.
    Raises ValueError for a t the layout cannot compile."""
    import jax

    par = engine.parallel
    cfg = engine.cfg
    single = par.num_devices == 1
    m = 1 if single else (m or par.in_flight)
    t = engine.bucket(n) if t is None else t
    if t < n or (not single and t % par.token_multiple):
        raise ValueError(f"compiled length t={t} must be >= n={n}" + ("" if single else
                         f" and a multiple of 2*ring*ulysses*seq_chunks = {par.token_multiple}"))
    compiled = engine.compiled(t, m)
    text = compiled.as_text()
    tiles = _tiles(engine)
    ep = 1 if single else par.expert_degree(cfg)  # the engine's EP degree (default on when R·U divides E)
    model = flops.per_device(cfg, par.pipeline, par.ring, par.ulysses, t, n, m, tiles, ep)
    xf = hlo.matmul_flops(text)
    xla_flops = xf["static"]
    for op, per_pass in xf["dynamic"].items():
        full, one = model["classes"][_loop_class(op)]
        xla_flops += per_pass * (full / one if one else 0.0)
    b = engine.dtype.itemsize
    if single:
        xla_bytes = pred_bytes = 0.0
    else:
        width = traffic.collective_element_bytes(engine.dtype, jax.default_backend())
        xla_bytes = float(traffic.hlo_bytes_by_scope(text).get("total", 0))
        pred_bytes = (traffic.analytic_bytes(cfg, par, t, m, engine.plan.slots_per_stage, width)["total"]
                      + moe_traffic.moe_traffic(cfg, par, t, m, engine.plan.slots_per_stage, width,
                                                 engine.options).block_total)
    mem = compiled.memory_analysis()
    xla_mem = float(mem.argument_size_in_bytes + mem.temp_size_in_bytes)
    pred_mem = (memory.param_bytes(cfg, b, par.pipeline, ep, ring=par.ring, ulysses=par.ulysses)["total"]
                + memory.input_bytes(t, m, par.ring * par.ulysses)
                + memory.temp_bytes(cfg, par.pipeline, par.ring, par.ulysses, t, m, b, tiles, ep)["total"])

    def ratio(a, b):
        return a / b if b else (1.0 if a == b else float("inf"))

    return {"layout": f"{par.pipeline}x{par.ring}x{par.ulysses}", "tokens": n, "bucket": t, "requests": m,
            "model_flops": model["total"], "xla_flops": xla_flops, "flops_ratio": ratio(model["total"], xla_flops),
            "model_collective_bytes": pred_bytes, "xla_collective_bytes": xla_bytes,
            "bytes_ratio": ratio(pred_bytes, xla_bytes),
            "model_memory_bytes": pred_mem, "xla_argument_bytes": int(mem.argument_size_in_bytes),
            "xla_temp_bytes": int(mem.temp_size_in_bytes), "memory_ratio": ratio(pred_mem, xla_mem)}


def padding_work(engine, n: int) -> dict:
    """Compiled work of an n-token prompt in its bucket vs the same prompt compiled at exactly n tokens (one device:
    `engine.parallel` must be 1×1×1, the only layout that admits every length). Two measures of each program:
    `compare`'s XLA FLOPs (HLO dots × known trip counts, dynamic loops × the model's trip counts) and XLA's own
    `cost_analysis()["flops"]` (every loop body counted once). Returns a JSON-ready row with both ratios
    (bucket / exact). Raises ValueError on a multi-device engine."""
    if engine.parallel.num_devices != 1:
        raise ValueError(f"padding_work needs a one-device engine (got {engine.parallel.num_devices} devices): "
                         "only there can a program be compiled at any exact length")
    t = engine.bucket(n)
    rows = {"bucket": compare(engine, n, 1, t), "exact": compare(engine, n, 1, n)}

    def cost_flops(length):
        ca = engine.compiled(length, 1).cost_analysis()
        return float((ca[0] if isinstance(ca, list) else ca)["flops"])

    cost = {"bucket": cost_flops(t), "exact": cost_flops(n)}
    return {"tokens": n, "bucket": t, "xla_flops_bucket": rows["bucket"]["xla_flops"],
            "xla_flops_exact": rows["exact"]["xla_flops"],
            "xla_ratio": rows["bucket"]["xla_flops"] / rows["exact"]["xla_flops"],
            "model_ratio": rows["bucket"]["model_flops"] / rows["exact"]["model_flops"],
            "cost_analysis_flops_bucket": cost["bucket"], "cost_analysis_flops_exact": cost["exact"],
            "cost_analysis_ratio": cost["bucket"] / cost["exact"]}


def attention_work(engine, n: int) -> tuple[float, float]:
    """(measured, modelled) attention score entries on the busiest device for one n-token prompt: the compiled
    program's own count (`attention.count_work`: visited tiles × tile area) vs the model's tile ranges."""
    import numpy as np

    from slope_jax.model import attention

    par = engine.parallel
    cfg = engine.cfg
    # a fresh engine of the same class (plan sits below serve: no import of it), traced inside count_work
    fresh = type(engine)(cfg, engine.params, par, engine.dtype, devices=list(engine.mesh.devices.reshape(-1)),
                         _placed=True, options=engine.options)
    with attention.count_work({"pipeline": par.pipeline, "ring": par.ring, "ulysses": par.ulysses}) as counter:
        fresh.prefill([np.arange(n) % cfg.vocab_size], return_kv=False)
    measured = max(counter.work.values())
    t = engine.bucket(n)
    model = flops.per_device(cfg, par.pipeline, par.ring, par.ulysses, t, n, 1, _tiles(engine))
    # work counts score entries; FLOPs are 4·heads·H per entry (heads N on sliding layers, N/U on full layers)
    per_entry_sl = 4 * cfg.num_attention_heads * cfg.head_dim
    per_entry_full = 4 * (cfg.num_attention_heads // par.ulysses) * cfg.head_dim
    c = model["classes"]
    entries = c["sliding"][0] / per_entry_sl + (c["step0"][0] + c["ring"][0]) / per_entry_full
    # the model counts every one of the 1 + P − 1 ticks (the critical path); a stage visits tiles on its live one only
    return float(measured), float(entries) / par.pipeline


def _tiles(engine) -> flops.Tiles:
    """The engine's tile sizes: its step options (`flops.Tiles` is `StepOptions`)."""
    return engine.options
