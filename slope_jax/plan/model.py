"""The cost model: FLOPs, bytes per link, memory and predicted TTFT of one prefill step.

TTFT model (per compiled step of `M` requests, `P` stages of `S` slots, `M + P − 1` ticks):
  compute time of a part = its FLOPs / (peak × efficiency of its kind) — matmuls (projections, MoE, head) and
  attention have separate efficiencies (from the hardware profile: cited measurements, or `calibrate` on the CPU) —
  + activation elements × `element_s` + attention score entries × `attention_entry_s` (`hardware.Efficiency`;
  0 where not fitted): the terms that do not scale with FLOPs, so that a profile carries over to other widths;
  a prefix hit's score entries over its cached keys × `prefix_entry_s` (default `attention_entry_s`);
  + MoE tiles × `moe_tile_s` (per expert-loop iteration); weights: parameter bytes per device × ticks ×
  `weight_byte_s` (streamed once per layer pass), on a device of its own at least the part of reading them at
  `hbm_bytes_per_s` that the compute does not hide (a roofline floor, `_weight_s`);
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
    # the capacity `fits_memory` is checked against (the profile's usable bytes, `Hardware.usable_bytes`, unless
    # `memory_limit_bytes` was given) and what is left of it: capacity − memory_bytes_per_device (< 0: does not fit)
    memory_limit_bytes: float = 0.0
    headroom_bytes: float = 0.0

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
            tiles: flops.Tiles | None = None, memory_limit_bytes: float | None = None,
            bucket: int | None = None, cached: int = 0) -> Prediction:
    """Predict one prefill step of `batch` requests of `length` tokens on `parallel` (formulas: the module docstring).

    Args:
      cfg: the model. parallel: layout (EP degree `parallel.expert_degree(cfg)`, as the engine runs it).
      length: prompt tokens (padded to the engine's bucket). hardware: profile name, JSON path or Hardware.
      batch: requests per step (default 1: the TTFT of a request on an idle server).
      dtype: activation dtype (default float32 on shared-compute CPU profiles, else bfloat16).
      devices_per_host: for the link kind of each collective. tiles: the engine's step options (default: the
        profile's `step_options`, the ones its efficiencies were fitted with, else the engine's defaults).
      memory_limit_bytes: capacity (default `Hardware.usable_bytes`: HBM × memory_fraction − runtime reserve).
      bucket: padded length (default the engine's bucket policy); must be >= length and a multiple of 2·R·U.
      cached: prefix hit: `length` (and `bucket`) new tokens after `cached` reused ones, whose attention over the
        cached keys is added (`flops.cached_prefix_attention`). Returns: a Prediction. Raises LayoutError (the
        layout breaks a rule) or HardwareError (bad profile).
    """
    hw, _ = load(hardware), parallel.validate(cfg)
    tiles = flops.Tiles(**hw.step_options) if tiles is None else tiles
    dtype = dtype or ("float32" if hw.shared_compute else "bfloat16")
    hw = hw.for_dtype(dtype)  # the efficiency fitted for this activation dtype, where the profile has one
    b, (P, R, U) = DTYPE_BYTES[dtype], (parallel.pipeline, parallel.ring, parallel.ulysses)
    ep = parallel.expert_degree(cfg)  # validate() checked it: 1, or R·U dividing num_experts
    m, t, devices = batch or 1, _bucket(length, parallel, bucket), parallel.num_devices
    n, C = min(length, t), parallel.seq_chunks
    peak = hw.peak(dtype) / (devices if hw.shared_compute else 1)  # virtual devices share the host's cores
    f = _with_cached_prefix(flops.per_device(cfg, P, R, U, t, n, m, tiles, ep),
                            flops.cached_prefix_attention(cfg, P, R, U, t, cached, m, tiles), cfg)
    S, _ = flops.stage_slots(cfg, P) if devices > 1 else (cfg.num_hidden_layers, cfg.num_hidden_layers)
    ticks = m + P - 1 if devices > 1 else m
    chunk_ratio = _chunk_ratio(cfg, t, P, R, U, C, m) if C > 1 and P > 1 else 1.0
    times = _compute_times(cfg, hw, f, peak, devices, chunk_ratio)
    links = _links(parallel, devices_per_host)
    lb, comm = _communication(cfg, hw, parallel, f, t, m, S, b, ep, tiles, peak, links)
    compute_s, comm_s = sum(times.values()), sum(comm.values())
    ticks_run = m * C + P - 1 if devices > 1 else m
    eff, share = hw.efficiency, devices if hw.shared_compute else 1
    overhead_s = eff.overhead_s + eff.layer_overhead_s * ticks_run * S
    params = memory.param_bytes(cfg, b, P, ep, ring=R, ulysses=U)
    weight_s = _weight_s(hw, params["total"] * ticks_run, compute_s, share)
    step_s = compute_s + comm_s + overhead_s + weight_s
    mem_total = sum((mem := _memory(cfg, parallel, t, m, b, tiles, ep, params)).values())
    limit = hw.usable_bytes if memory_limit_bytes is None else memory_limit_bytes
    model_f = flops.model_flops(cfg, n) * m
    assumptions = _assumptions(hw, cfg, parallel, dtype, peak, length, t, m, ticks, S, ep, tiles, chunk_ratio)
    return Prediction(
        pipeline=P, ring=R, ulysses=U, expert=ep, length=length, bucket=t, batch=m, ttft_ms=step_s * 1e3,
        step_ms=step_s * 1e3, compute_ms=compute_s * 1e3, communication_ms=comm_s * 1e3,
        fill_ms=(step_s * (P - 1) / ticks_run if devices > 1 else 0.0) * 1e3,
        time_breakdown_ms=_breakdown_ms(times, weight_s, overhead_s, comm), layer_slots=ticks * S,
        flops_per_device=f["total"], model_flops=model_f,
        mfu=model_f / (devices * hw.peak(dtype) / (devices if hw.shared_compute else 1) * step_s),
        memory_bytes_per_device=mem_total, memory_breakdown=mem, fits_memory=mem_total <= limit,
        collective_bytes_per_device=lb["total"],
        link_bytes_per_device={k: lb[k] for k in traffic.LINK_KINDS}, link_kind=links, hardware=hw.name,
        assumptions=assumptions, seq_chunks=C, memory_limit_bytes=float(limit),
        headroom_bytes=float(limit - mem_total))


def _with_cached_prefix(f: dict, extra: float, cfg: ModelConfig) -> dict:
    """`flops.per_device`'s counts plus a prefix hit's attention over its cached keys: its FLOPs join `attention`
    (same efficiency), its score entries are counted apart (`prefix_entries`, costed at `Efficiency.prefix_entry`)."""
    f = dict(f, prefix_entries=0.0)
    if extra:
        f["attention"] += extra
        f["total"] += extra
        f["prefix_entries"] = extra / (4 * cfg.head_dim)
    return f


def _bucket(length: int, parallel: ParallelConfig, bucket: int | None) -> int:
    """The padded length: `bucket`, checked (>= length, a multiple of 2·R·U), or the engine's bucket policy."""
    t = bucket_length(length, parallel) if bucket is None else bucket
    if t < length or t % parallel.token_multiple:
        raise ValueError(f"bucket={t}: must be >= length={length} and a multiple of 2*ring*ulysses="
                         f"{parallel.token_multiple}")
    return t


def _weight_s(hw: Hardware, bytes_read: float, compute_s: float, share: int) -> float:
    """Seconds of a step spent on its weights beyond its compute: `bytes_read` (parameter bytes per device × layer
    passes) × `weight_byte_s` where the profile fitted it (the CPU), and on a device of its own at least the part of
    reading them from HBM (`hbm_bytes_per_s`) that the compute does not hide — the roofline floor of a short step:
    one token of gpt-oss-20b on an H100 was predicted at 0.25 ms, under the ~4 ms its 13 GiB of weights take to read
    (Williams, Waterman & Patterson 2009, roofline). `calibrate` fits `weight_byte_s` as an added term, which is what
    this returns on shared-compute (CPU) profiles; a device profile fitted on rows where the floor binds would not
    reproduce its fit (the H200's is fitted at 8K/32K tokens, far above it)."""
    fitted = bytes_read * hw.efficiency.weight_byte_s * share
    if hw.shared_compute:
        return fitted
    return max(fitted, bytes_read / hw.hbm_bytes_per_s - compute_s)


def _breakdown_ms(times: dict[str, float], weight_s: float, overhead_s: float, comm: dict[str, float]
                  ) -> dict[str, float]:
    """`Prediction.time_breakdown_ms`: the compute parts (matmul includes the head), weights, overhead and each
    collective's exposed time, in ms."""
    return {"matmul": (times["matmul"] + times["head"]) * 1e3, "attention": times["attention"] * 1e3,
            "elementwise": times["elementwise"] * 1e3, "attention_entries": times["attention_entries"] * 1e3,
            "prefix_entries": times["prefix_entries"] * 1e3, "moe_tiles": times["moe_tiles"] * 1e3,
            "weights": weight_s * 1e3, "overhead": overhead_s * 1e3} | {k: v * 1e3 for k, v in comm.items()}


def _compute_times(cfg: ModelConfig, hw: Hardware, f: dict, peak: float, devices: int, chunk_ratio: float
                   ) -> dict[str, float]:
    """Seconds of each compute part of a step from its executed FLOPs `f` (`flops.per_device`): matmul (projections
    + MoE), head, attention (FLOPs / (peak × efficiency)), the per-element, per-score-entry and per-MoE-tile terms;
    all scaled by `chunk_ratio` (sequence-pipelined prefill: the stages overlap on a request's chunks)."""
    eff = hw.efficiency
    share = devices if hw.shared_compute else 1  # per-element terms: virtual devices share the host's cores
    out = {"matmul": (f["projections"] + f["moe"]) / (peak * eff.matmul),
           "attention": f["attention"] / (peak * eff.attention_for(devices)),
           "head": f["head"] / (peak * eff.matmul),
           "elementwise": f["elements"] * eff.element_s * share,
           "attention_entries": f["attention_entries"] * eff.attention_entry_s * share,
           "prefix_entries": f.get("prefix_entries", 0.0) * eff.prefix_entry * share,
           "moe_tiles": f["moe_tiles"] * eff.moe_tile_s * share}
    return {k: v * chunk_ratio for k, v in out.items()}


def _communication(cfg: ModelConfig, hw: Hardware, parallel: ParallelConfig, f: dict, t: int, m: int, S: int, b: int,
                   ep: int, tiles: flops.Tiles, peak: float, links: dict[str, str]) -> tuple[dict, dict[str, float]]:
    """(bytes per link kind `traffic.link_bytes`, seconds per collective kind not hidden behind compute): each
    collective's bytes / its link's bandwidth, except the ring's K/V ppermute, which only costs what exceeds the
    ring step's attention compute (`ring_ppermute_exposed`)."""
    devices, eff = parallel.num_devices, hw.efficiency
    share = devices if hw.shared_compute else 1
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
                      if parallel.ring > 1 else 0.0)
    ring_transfer_s = lb["ring_ppermute"] / bw[links["ring_ppermute"]]
    comm = {k: lb[k] / bw[links[k]] for k in traffic.LINK_KINDS if k != "ring_ppermute"}
    comm["ring_ppermute_exposed"] = max(ring_compute_s, ring_transfer_s) - ring_compute_s
    return lb, comm


def _memory(cfg: ModelConfig, parallel: ParallelConfig, t: int, m: int, b: int, tiles: flops.Tiles, ep: int,
            params: dict[str, float]) -> dict[str, float]:
    """Predicted bytes per device by part (`plan.memory`): parameters, inputs, temporaries, K/V export."""
    P, R, U = parallel.pipeline, parallel.ring, parallel.ulysses
    temps = memory.temp_bytes(cfg, P, R, U, t, m, b, tiles, ep)
    return {"parameters": params["total"], "inputs": memory.input_bytes(t, m, R * U),
            "temporaries": temps["total"], "kv_export": memory.kv_export_bytes(cfg, P, R, U, t, m, b)}


def _assumptions(hw: Hardware, cfg: ModelConfig, parallel: ParallelConfig, dtype: str, peak: float, length: int,
                 t: int, m: int, ticks: int, S: int, ep: int, tiles: flops.Tiles, chunk_ratio: float) -> list[str]:
    """The assumptions behind a prediction, one sentence each (returned with every Prediction)."""
    devices, eff = parallel.num_devices, hw.efficiency
    out = [
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
        f"memory: {hw.memory_budget()}",
    ]
    if ep > 1:
        if tiles.resolve("").ep_dispatch == "all_to_all":
            rows = tiles.ep_rows(t // (parallel.ring * parallel.ulysses), cfg.experts_per_token, ep)
            out.append(f"EP{ep}: all-to-all dispatch, one round of c = {rows} rows per device pair "
                       "(routing no more skewed than ep_capacity allows), (EP-1) x c x (D x b + 8k + 4D) "
                       "bytes per MoE block (plan.moe_traffic)")
        else:
            out.append(f"EP{ep}: all-gather tokens + reduce-scatter outputs, (EP-1) x T_local x "
                       "(D x b + 8k + 4D) bytes per MoE block (plan.moe_traffic)")
    if parallel.seq_chunks > 1 and parallel.pipeline > 1:
        out.append(f"seq_chunks={parallel.seq_chunks}: compute scaled by the chunked critical path / the unchunked "
                   f"one ({chunk_ratio:.3f}; plan.seq_chunks: lock-step ticks, fill and attention imbalance); the "
                   "prefix-attention query ring over earlier chunks is not counted in the link bytes")
    return out


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
