"""Expert parallelism: per-device parameter memory and MoE collective traffic.

    python benchmarks/ep_memory.py                     # declared shapes of gpt-oss-20b/-120b + a measured check
    python benchmarks/ep_memory.py --nomeasure         # declared shapes only (no compile)

Part 1 (declared shapes, no allocation): per-device parameter bytes of gpt-oss-120b and -20b (bf16 + MXFP4 experts,
as released) for layouts (P, R, U) with expert parallelism on (EP = R·U, experts split over the ring × Ulysses
devices of a stage) and off (EP = 1), from the model declaration and the sharding rules
(`pipeline.logical_rules`); the K/V a stage keeps for one T-token prompt (all of its layers, T/(R·U) tokens,
bf16); whether parameters + K/V fit one device of --device_gb GB (activations and XLA temporaries not included:
`PrefillEngine.memory_per_device` reports those for a compiled bucket); and the MoE collective bytes per device and
prefill step from `slope_jax.plan.moe_traffic` at T tokens.
Part 2 (measured, 8 CPU devices, a small gpt-oss-shaped model): per-device expert bytes from the sharded arrays and
from `compiled.memory_analysis()` against total/(P·R·U), and the MoE collective bytes read from the compiled HLO
against the formula, for the all-to-all and the all-gather dispatch.
Prints tables and writes JSON (default benchmarks/results/ep_memory.json).
"""

from __future__ import annotations

import math
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_list("layouts", ["1x2x4", "1x4x8", "1x1x8", "2x2x4", "4x2x1"],
                  "Declared-shape layouts, each pipeline x ring x ulysses.")
flags.DEFINE_float("device_gb", 64.0, "Device memory in GB (10^9 bytes) for the fit column.")
flags.DEFINE_integer("tokens", 131072, "Prompt length T for the K/V and traffic columns.")
flags.DEFINE_bool("measure", True, "Also run the measured check on 8 CPU devices (compiles a small model).")
flags.DEFINE_string("out", "benchmarks/results/ep_memory.json", "JSON output path.")

EXPERT_PARAMS = ("w1_blocks", "w1_scales", "w2_blocks", "w2_scales", "w1", "w2", "b1", "b2")
SMALL = dict(num_hidden_layers=4, num_experts=32, experts_per_token=4, vocab_size=4096, hidden_size=256,
             intermediate_size=256, num_attention_heads=16, num_key_value_heads=8, head_dim=32, sliding_window=128)


def _leaves(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def declared(cfg, name: str, layout, expert: int | None, tokens: int, device_gb: float) -> dict:
    """Per-device bytes of one layout from the declared shapes and the sharding rules (the engine's own tables)."""
    from slope_jax.model import gpt_oss as model
    from slope_jax.parallel import sharding, stages
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.plan import moe_traffic

    p, r, u = layout
    par = ParallelConfig(pipeline=p, ring=r, ulysses=u, expert=expert).validate(cfg)
    ep = par.expert_degree(cfg)
    plan = stages.plan_stages(cfg, p)
    specs = sharding.stacked_param_specs(cfg, par, "bfloat16")
    per_dev = {"experts": 0, "other": 0}
    for path, spec in _leaves(specs):
        div = stages.shards(spec.axes, cfg, par)
        nbytes = math.prod(spec.shape) * spec.dtype.itemsize
        assert nbytes % div == 0, (path, spec.shape, div)
        per_dev["experts" if path.split("/")[-1] in EXPERT_PARAMS else "other"] += nbytes // div
    total = {"experts": 0, "other": 0}
    for path, spec in _leaves(model.param_specs(cfg, "bfloat16")):
        total["experts" if path.split("/")[-1] in EXPERT_PARAMS else "other"] += \
            math.prod(spec.shape) * spec.dtype.itemsize
    params = per_dev["experts"] + per_dev["other"]
    # K/V of one prompt kept by a device: its stage's stack of n layers × T/(R·U) tokens × K·H, K and V, bf16
    kv = plan.stack_per_stage * (tokens // (r * u)) * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    t_pad = -(-tokens // par.token_multiple) * par.token_multiple
    tr = moe_traffic.moe_traffic(cfg, par, t_pad, par.in_flight, plan.slots_per_stage, 2)
    return {"model": name, "pipeline": p, "ring": r, "ulysses": u, "expert_degree": ep,
            "per_device_param_bytes": params, "per_device_expert_bytes": per_dev["experts"],
            "per_device_other_bytes": per_dev["other"], "total_expert_bytes": total["experts"],
            "total_other_bytes": total["other"],
            "expert_ratio_to_total_over_PRU": per_dev["experts"] / (total["experts"] / (p * r * u)),
            "kv_bytes_per_device": kv, "tokens": tokens,
            "fits_params_and_kv": params + kv <= device_gb * 1e9, "device_gb": device_gb,
            "moe_wire_bytes_per_step": tr.wire, "moe_operand_bytes_per_step": tr.operand}


def measured(layout, dispatch: str) -> dict:
    import jax
    import numpy as np

    from slope_jax.checkpoints import writer as checkpoint_writer
    from slope_jax.model.config import FULL, SLIDING, ModelConfig
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.plan import moe_traffic, traffic
    from slope_jax.serve.engine import PrefillEngine

    cfg = ModelConfig(**SMALL, layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(4)))
    host = checkpoint_writer.random_params(cfg, 0)
    p, r, u = layout
    par = ParallelConfig(pipeline=p, ring=r, ulysses=u)
    eng = PrefillEngine(cfg, host, par, "bfloat16", q_tile=128, kv_tile=128, moe_tile=64, ep_dispatch=dispatch)
    layers = eng.params["layers"]
    names = [k for k in EXPERT_PARAMS if k in layers]
    total = sum(layers[k].nbytes for k in names)
    devices = list(eng.mesh.devices.reshape(-1))

    def dev_bytes(tree, d):
        return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == d)

    per_dev = [dev_bytes({k: layers[k] for k in names}, d) for d in devices]
    t, m = 512, par.in_flight
    compiled = eng.compiled(t, m)
    args = compiled.memory_analysis().argument_size_in_bytes
    inputs = (m * t + t) * 4 // (r * u) + 4 * m
    other = dev_bytes(eng.params, devices[0]) - per_dev[0]
    hlo = compiled.as_text()
    keep = [x for x in hlo.splitlines() if "/expert_parallel/" in x
            or not any(f" {c}(" in x or f" {c}-start(" in x for c in traffic.COLLECTIVES)]
    meas = sum(c.total for c in traffic.hlo_collectives("\n".join(keep)))
    width = traffic.collective_element_bytes(np.dtype("bfloat16"), jax.default_backend())
    pred = moe_traffic.moe_traffic(cfg, par, t, m, eng.plan.slots_per_stage, width, eng.options)
    return {"layout": {"pipeline": p, "ring": r, "ulysses": u}, "expert_degree": par.expert_degree(cfg),
            "dispatch": dispatch, "rows_per_pair": pred.rows, "tokens_local": t // (r * u),
            "formula_moe_wire_bytes": pred.wire,
            "total_expert_bytes": total, "per_device_expert_bytes": per_dev, "ideal": total / (p * r * u),
            "memory_analysis_expert_bytes": int(args - inputs - other),
            "hlo_moe_block_bytes": int(meas), "formula_moe_block_bytes": pred.block_total,
            "collective_element_bytes": width}


def main(argv):
    del argv
    load0 = start_load()
    from slope_jax.model.config import ModelConfig

    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for name in ("gpt-oss-120b", "gpt-oss-20b"):
        cfg = ModelConfig.from_json(os.path.join(here, "..", "configs", f"{name}.json"))
        for s in FLAGS.layouts:
            layout = tuple(int(x) for x in s.split("x"))
            for expert in (None, 1):
                if expert is None and cfg.num_experts % (layout[1] * layout[2]):
                    continue
                row = declared(cfg, name, layout, expert, FLAGS.tokens, FLAGS.device_gb)
                if expert == 1 and row["ring"] * row["ulysses"] == 1:
                    continue  # identical to the EP row
                rows.append(row)
    gib = 2 ** 30
    print(f"\ndeclared per-device bytes (bf16 + MXFP4 experts); K/V of one {FLAGS.tokens}-token prompt (bf16); "
          f"fit = parameters + K/V <= {FLAGS.device_gb:g} GB (activations/temporaries not included)")
    print(f"{'model':>13} {'P,R,U':>7} {'EP':>3} {'params GiB':>11} {'experts GiB':>12} {'other GiB':>10} "
          f"{'exp ratio':>10} {'K/V GiB':>8} {'fits':>5} {'MoE wire GiB/step':>18}")
    for d in rows:
        print(f"{d['model']:>13} {d['pipeline']},{d['ring']},{d['ulysses']:<3} {d['expert_degree']:>3} "
              f"{d['per_device_param_bytes'] / gib:>11.2f} {d['per_device_expert_bytes'] / gib:>12.2f} "
              f"{d['per_device_other_bytes'] / gib:>10.2f} {d['expert_ratio_to_total_over_PRU']:>10.3f} "
              f"{d['kv_bytes_per_device'] / gib:>8.2f} {'yes' if d['fits_params_and_kv'] else 'no':>5} "
              f"{d['moe_wire_bytes_per_step'] / gib:>18.2f}")
    for d in rows:
        if d["model"] == "gpt-oss-120b" and d["pipeline"] == 1 and d["expert_degree"] > 1:
            print(f"gpt-oss-120b at (P,R,U)=({d['pipeline']},{d['ring']},{d['ulysses']}) with EP={d['expert_degree']}: "
                  f"{d['per_device_param_bytes'] / gib:.2f} GiB of parameters per device -> one stage "
                  f"{'fits' if d['fits_params_and_kv'] else 'does NOT fit'} on {FLAGS.device_gb:g} GB devices "
                  f"(with {d['kv_bytes_per_device'] / gib:.2f} GiB K/V at T={FLAGS.tokens})")
    meas = []
    if FLAGS.measure:
        meas = [measured(x, d) for x in ((1, 2, 4), (2, 2, 2), (1, 8, 1)) for d in ("all_to_all", "all_gather")]
        print("\nmeasured on 8 CPU devices (small model, bf16 + MXFP4): expert bytes per device and MoE collective "
              "bytes (as the HLO reader counts them, the whole step, one all-to-all round); wire = formula bytes "
              "leaving a device")
        print(f"{'P,R,U':>7} {'EP':>3} {'dispatch':>10} {'c/T_loc':>8} {'arrays max KiB':>15} {'total/PRU KiB':>14} "
              f"{'mem_analysis KiB':>17} {'HLO MoE KiB':>12} {'formula KiB':>12} {'wire KiB':>9}")
        for m in meas:
            lay = m["layout"]
            share = f"{m['rows_per_pair']}/{m['tokens_local']}" if m["dispatch"] == "all_to_all" else "-"
            print(f"{lay['pipeline']},{lay['ring']},{lay['ulysses']:<3} {m['expert_degree']:>3} {m['dispatch']:>10} "
                  f"{share:>8} {max(m['per_device_expert_bytes']) / 1024:>15.1f} {m['ideal'] / 1024:>14.1f} "
                  f"{m['memory_analysis_expert_bytes'] / 1024:>17.1f} {m['hlo_moe_block_bytes'] / 1024:>12.1f} "
                  f"{m['formula_moe_block_bytes'] / 1024:>12.1f} {m['formula_moe_wire_bytes'] / 1024:>9.1f}")
    write_result(FLAGS.out, {"declared": rows, "measured": meas, "small_config": SMALL}, load_start=load0)
    print(f"\nwrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
