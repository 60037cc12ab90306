"""The cost model: FLOPs, bytes per link, memory and predicted TTFT of one prefill step.

TTFT model (per compiled step of `M` requests, `P` stages of `S` slots, `M + P − 1` ticks):
  compute time of a part = its FLOPs / (peak × efficiency of its kind) — matmuls (projections, MoE, head) and
  attention have separate efficiencies (from the hardware profile: cited measurements, or `calibrate` on the CPU) —
  + activation elements × `element_s` + attention score entries × `attention_entry_s` (`hardware.Efficiency`;
  0 where not fitted): the terms that do not scale with FLOPs, so that a profile carries over to other widths;
  + MoE tiles × `moe_tile_s` (per expert-loop iteration); weights: parameter bytes per device × ticks ×
  `weight_byte_s` (streamed once per layer pass);
  full layer   = projections + MoE + Ulysses all-to-alls (not overlapped) + ring step 0 +
                 (R − 1) × max(ring step compute, K/V block transfer) (the next block's ppermute overlaps the current
                 block's attention) + EP dispatch (not overlapped; `plan.moe_traffic`, the step's `ep_dispatch`);
  sliding layer = projections + MoE + attention + halo hops (not overlapped) + EP dispatch;
  tick = S/2 × (sliding + full) + hand-off to the next stage + per-slot overhead; step = ticks × tick + overhead.
  A request's TTFT (idle server) is the step time with M = 1; the pipeline fill is the (P − 1) extra ticks.
Links: Ulysses groups sit inside a host (mesh order pipeline, ring, ulysses; ulysses innermost), ring and pipeline
neighbours are on another host once a group spans hosts; a transfer's time is bytes / that link's bandwidth.
Every figure is returned with the assumptions it rests on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slope_jax.model.config import ModelConfig
from slope_jax.parallel.config import ParallelConfig
from slope_jax.plan import flops, memory, seq_chunks, traffic
from slope_jax.plan.hardware import Hardware, load

DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2}


@dataclasses.dataclass
class Prediction:
    """Predicted cost of one prefill step on one layout (units in the field names; bytes and FLOPs per device)."""

    pipeline: int
    ring: int
    ulysses: int
    expert: int
    length: int
    bucket: int
    batch: int
    ttft_ms: float
    step_ms: float
    compute_ms: float
    communication_ms: float
    fill_ms: float
    time_breakdown_ms: dict[str, float]
    layer_slots: int
    flops_per_device: float
    model_flops: float
    mfu: float
    memory_bytes_per_device: float
    memory_breakdown: dict[str, float]
    fits_memory: bool
    collective_bytes_per_device: float
    link_bytes_per_device: dict[str, float]
    link_kind: dict[str, str]
    hardware: str
    assumptions: list[str]
    seq_chunks: int = 1

    @property
    def layout(self) -> str:
        return (f"P{self.pipeline}xR{self.ring}xU{self.ulysses}" + (f"+EP{self.expert}" if self.expert > 1 else "")
                + (f"+C{self.seq_chunks}" if self.seq_chunks > 1 else ""))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layout"] = self.layout
        return d


def bucket_length(n: int, parallel: ParallelConfig) -> int:
    """The engine's padded length for an n-token prompt (`parallel.layout.bucket_length`, numpy only)."""
    from slope_jax.parallel import layout

    return layout.bucket_length(n, multiple=parallel.token_multiple)


def _links(parallel: ParallelConfig, devices_per_host: int) -> dict[str, str]:
    """Which link each collective uses ("intra" or "inter" host), from the mesh order (ulysses innermost)."""
    R, U = parallel.ring, parallel.ulysses
    dph = max(1, devices_per_host)
    return {"ulysses_all_to_all": "intra" if U <= dph else "inter",
            "ring_ppermute": "intra" if R * U <= dph else "inter",
            "halo_ppermute": "intra" if R * U <= dph else "inter",
            "pipeline_handoff": "intra" if parallel.num_devices <= dph else "inter",
            "ep_dispatch": "intra" if R * U <= dph else "inter",
            "other": "intra" if parallel.num_devices <= dph else "inter"}


def predict(cfg: ModelConfig, parallel: ParallelConfig, length: int, hardware: str | Hardware = "cpu", *,
            batch: int | None = None, dtype: str | None = None, devices_per_host: int = 8,
            tiles: flops.Tiles = flops.Tiles(), memory_limit_bytes: float | None = None,
            bucket: int | None = None) -> Prediction:
    """Predict one prefill step of `batch` requests of `length` tokens on `parallel` (formulas: the module docstring).

    Args:
      cfg: the model. parallel: layout (EP degree `parallel.expert_degree(cfg)`, as the engine runs it).
      length: prompt tokens (padded to the engine's bucket). hardware: profile name, JSON path or Hardware.
      batch: requests per step (default 1: the TTFT of a request on an idle server).
      dtype: activation dtype (default float32 on shared-compute CPU profiles, else bfloat16).
      devices_per_host: for the link kind of each collective. tiles: the engine's tile sizes.
      memory_limit_bytes: capacity to check against (default the profile's HBM).
      bucket: padded length (default the engine's bucket policy); must be >= length and a multiple of 2·R·U.
    Returns: a Prediction. Raises LayoutError (the layout breaks a rule) or HardwareError (bad profile).
    """
    hw = load(hardware)
    parallel.validate(cfg)
    dtype = dtype or ("float32" if hw.shared_compute else "bfloat16")
    b = DTYPE_BYTES[dtype]
    P, R, U = parallel.pipeline, parallel.ring, parallel.ulysses
    ep = parallel.expert_degree(cfg)  # validate() checked it: 1, or R·U dividing num_experts
    m = batch or 1
    t = bucket_length(length, parallel) if bucket is None else bucket
    if t < length or t % parallel.token_multiple:
        raise ValueError(f"bucket={t}: must be >= length={length} and a multiple of 2*ring*ulysses="
                         f"{parallel.token_multiple}")
    n = min(length, t)
    devices = parallel.num_devices
    peak = hw.peak(dtype)
    if hw.shared_compute:
        peak /= devices  # virtual devices share the host's cores
    eff = hw.efficiency
    f = flops.per_device(cfg, P, R, U, t, n, m, tiles, ep)
    S, _ = flops.stage_slots(cfg, P) if devices > 1 else (cfg.num_hidden_layers, cfg.num_hidden_layers)
    ticks = m + P - 1 if devices > 1 else m
    mm_s = (f["projections"] + f["moe"]) / (peak * eff.matmul)
    head_s = f["head"] / (peak * eff.matmul)
    att_s = f["attention"] / (peak * eff.attention_for(devices))
    # per-element terms (seconds per element of one device; virtual devices share the host's cores)
    share = devices if hw.shared_compute else 1
    elem_s = f["elements"] * eff.element_s * share
    entry_s = f["attention_entries"] * eff.attention_entry_s * share
    tile_s = f["moe_tiles"] * eff.moe_tile_s * share

    links = _links(parallel, devices_per_host)
    bw = {"intra": hw.intra_host_bytes_per_s, "inter": hw.inter_host_bytes_per_s}
    if hw.shared_compute:  # virtual devices' collectives are copies through the one host's memory
        bw = {k: v / devices for k, v in bw.items()}
    if devices > 1:
        lb = traffic.link_bytes(cfg, parallel, t, m, S, b, ep, tiles)
    else:
        lb = {k: 0.0 for k in traffic.LINK_KINDS} | {"total": 0.0, "ring_step": 0.0}
    # ring: per step max(compute of the step's two blocks, transfer of the next K/V block)
    ring_compute_s = (f["classes"]["ring"][0] * (1 / (peak * eff.attention)
                                                 + eff.attention_entry_s * share / (4 * cfg.head_dim))
                      if R > 1 else 0.0)
    ring_transfer_s = lb["ring_ppermute"] / bw[links["ring_ppermute"]]
    ring_exposed_s = max(ring_compute_s, ring_transfer_s) - ring_compute_s
    comm = {k: lb[k] / bw[links[k]] for k in traffic.LINK_KINDS if k != "ring_ppermute"}
    comm["ring_ppermute_exposed"] = ring_exposed_s
    comm_s = sum(comm.values())
    C = parallel.seq_chunks
    chunk_ratio = _chunk_ratio(cfg, t, P, R, U, C, m) if C > 1 and P > 1 else 1.0
    # sequence-pipelined prefill: the stages overlap on a request's chunks
    mm_s, att_s, head_s = mm_s * chunk_ratio, att_s * chunk_ratio, head_s * chunk_ratio
    elem_s, entry_s, tile_s = elem_s * chunk_ratio, entry_s * chunk_ratio, tile_s * chunk_ratio
    compute_s = mm_s + att_s + head_s + elem_s + entry_s + tile_s
    ticks_run = m * C + P - 1 if devices > 1 else m
    overhead_s = eff.overhead_s + eff.layer_overhead_s * ticks_run * S
    params = memory.param_bytes(cfg, b, P, ep, ring=R, ulysses=U)
    weight_s = params["total"] * ticks_run * eff.weight_byte_s * share
    step_s = compute_s + comm_s + overhead_s + weight_s
    fill_s = step_s * (P - 1) / ticks_run if devices > 1 else 0.0

    temps = memory.temp_bytes(cfg, P, R, U, t, m, b, tiles, ep)
    mem = {"parameters": params["total"], "inputs": memory.input_bytes(t, m, R * U),
           "temporaries": temps["total"], "kv_export": memory.kv_export_bytes(cfg, P, R, U, t, m, b)}
    mem_total = sum(mem.values())
    limit = hw.hbm_bytes if memory_limit_bytes is None else memory_limit_bytes
    model_f = flops.model_flops(cfg, n) * m
    assumptions = [
        f"{hw.name}: peak {peak / 1e12:.4g} TFLOP/s per device ({dtype}"
        + (f", host peak shared by {devices} virtual devices" if hw.shared_compute else "") + ")",
        f"efficiency matmul {eff.matmul:.3g}, attention {eff.attention_for(devices):.3g}"
        + (f", {eff.element_s * 1e12:.3g} ps per activation element, {eff.attention_entry_s * 1e12:.3g} ps per score "
           "entry" if eff.element_s or eff.attention_entry_s else "")
        + (" (one-device program)" if devices == 1 and eff.attention_one_device is not None else "")
        + (f" ({eff.source})" if eff.source else ""),
        f"links: intra-host {hw.intra_host_bytes_per_s / 1e9:.4g} GB/s, inter-host "
        f"{hw.inter_host_bytes_per_s / 1e9:.4g} GB/s per device; Ulysses inside a host",
        f"bucket {t} tokens (prompt {length}); {m} request(s) per step over {ticks} tick(s) of {S} layer slot(s)",
        "MoE routing balanced over experts (tile padding per expert); ring transfer overlapped with ring compute",
    ]
    if ep > 1:
        if tiles.resolve("").ep_dispatch == "all_to_all":
            rows = tiles.ep_rows(t // (R * U), cfg.experts_per_token, ep)
            assumptions.append(f"EP{ep}: all-to-all dispatch, one round of c = {rows} rows per device pair "
                               "(routing no more skewed than ep_capacity allows), (EP-1) x c x (D x b + 8k + 4D) "
                               "bytes per MoE block (plan.moe_traffic)")
        else:
            assumptions.append(f"EP{ep}: all-gather tokens + reduce-scatter outputs, (EP-1) x T_local x "
                               "(D x b + 8k + 4D) bytes per MoE block (plan.moe_traffic)")
    if C > 1 and P > 1:
        assumptions.append(f"seq_chunks={C}: compute scaled by the chunked critical path / the unchunked one "
                           f"({chunk_ratio:.3f}; plan.seq_chunks: lock-step ticks, fill and attention imbalance); the "
                           "prefix-attention query ring over earlier chunks is not counted in the link bytes")
    return Prediction(
        pipeline=P, ring=R, ulysses=U, expert=ep, length=length, bucket=t, batch=m, ttft_ms=step_s * 1e3,
        step_ms=step_s * 1e3, compute_ms=compute_s * 1e3, communication_ms=comm_s * 1e3, fill_ms=fill_s * 1e3,
        time_breakdown_ms={"matmul": (mm_s + head_s) * 1e3, "attention": att_s * 1e3, "elementwise": elem_s * 1e3,
                           "attention_entries": entry_s * 1e3, "moe_tiles": tile_s * 1e3, "weights": weight_s * 1e3,
                           "overhead": overhead_s * 1e3}
        | {k: v * 1e3 for k, v in comm.items()}, layer_slots=ticks * S,
        flops_per_device=f["total"], model_flops=model_f,
        mfu=model_f / (devices * hw.peak(dtype) / (devices if hw.shared_compute else 1) * step_s),
        memory_bytes_per_device=mem_total, memory_breakdown=mem, fits_memory=mem_total <= limit,
        collective_bytes_per_device=lb["total"],
        link_bytes_per_device={k: lb[k] for k in traffic.LINK_KINDS}, link_kind=links, hardware=hw.name,
        assumptions=assumptions, seq_chunks=C)


def _chunk_ratio(cfg: ModelConfig, t: int, P: int, R: int, U: int, C: int, m: int) -> float:
    """Time of a step with C sequence chunks per request relative to the unchunked step (same devices, same work):
    one request (m = 1) from `seq_chunks.critical_path` (fill and attention imbalance included); m requests in
    flight from the tick counts ((m·C + P − 1) ticks of a chunk vs (m + P − 1) ticks of a whole request)."""
    if m == 1:
        one = seq_chunks.predict(cfg, t, pipeline=P, ring=R, ulysses=U, chunks=1, flops_per_s=1.0)
        chunked = seq_chunks.predict(cfg, t, pipeline=P, ring=R, ulysses=U, chunks=C, flops_per_s=1.0)
        return chunked["ttft_s"] / one["ttft_s"]
    return (m * C + P - 1) / (C * (m + P - 1))


def predict_tensor_parallel(cfg: ModelConfig, tp: int, length: int, hardware: str | Hardware, *,
                            dtype: str = "bfloat16") -> dict[str, Any]:
    """A one-host tensor-parallel engine (Megatron-style, e.g. TP8), for comparison: not a layout of this engine.

    FLOPs per device = model FLOPs / tp (a fused causal attention kernel: only visible pairs; heads split over tp);
    communication = 2 all-reduces of `[T, D]` per layer (after attention and after the MLP), ring all-reduce wire
    bytes `2·(tp−1)/tp·T·D·b` each, over the intra-host link, not overlapped; same efficiencies as `predict`.
    """
    hw = load(hardware)
    b = DTYPE_BYTES[dtype]
    peak = hw.peak(dtype)
    f = flops.prefill(cfg, length)
    compute_s = ((f["matmul"] + f["head"]) / hw.efficiency.matmul + f["attention"] / hw.efficiency.attention) / (
        tp * peak)
    wire = 2 * cfg.num_hidden_layers * 2 * (tp - 1) / tp * length * cfg.hidden_size * b
    comm_s = wire / hw.intra_host_bytes_per_s
    weights = memory.param_bytes(cfg, b, 1)["total"] / tp
    return {"layout": f"TP{tp}", "tp": tp, "length": length, "ttft_ms": (compute_s + comm_s) * 1e3,
            "compute_ms": compute_s * 1e3, "communication_ms": comm_s * 1e3, "flops_per_device": f["total"] / tp,
            "model_flops": f["total"], "all_reduce_bytes_per_device": wire, "weight_bytes_per_device": weights,
            "floor_ms": f["total"] / (tp * peak) * 1e3,
            "assumptions": [f"{hw.name} peak {peak / 1e12:.4g} TFLOP/s, efficiency matmul {hw.efficiency.matmul:.3g}"
                            f" attention {hw.efficiency.attention:.3g}", "2 ring all-reduces of [T, D] per layer "
                            f"over {hw.intra_host_bytes_per_s / 1e9:.4g} GB/s, not overlapped"]}
