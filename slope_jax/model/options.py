"""`StepOptions`: every compute option that shapes the compiled prefill step, in one frozen value (no JAX needed).

Parallel layout (`parallel.config.ParallelConfig`) and the activation dtype are separate: they also decide how
weights are stored and loaded. Everything else the step is compiled with lives here, is resolved once (`resolve`:
"auto" → the concrete choice for the backend), passed as one argument (engine → step builder → stage → layer),
logged by the engine, part of the launcher's start-up fingerprint (`to_dict`), and the source of the launcher's flags
(`FIELD_HELP`) and of the planner's tile model (`plan.flops.Tiles` is this class). JAX's persistent compilation
cache keys on the lowered program, which these options shape, so it never mixes programs of different options.
"""

from __future__ import annotations

import dataclasses
import math

ATTENTION_IMPLS = ("auto", "pallas", "xla", "cudnn")
MOE_IMPLS = ("auto", "ragged", "loop", "pallas")
EP_DISPATCHES = ("auto", "all_to_all", "all_gather")
BF16_MATMULS = ("auto", "native", "float32")
# `bf16_matmul="float32"` widens the XLA attention core's q, k, v only for query tiles of at least this many queries:
# with fewer, a tile's score matmuls are bound by reading the keys, which widening doubles. One call of 32 / 64 /
# 128 / 256 queries (16 heads over 4 KV heads, head_dim 64) over 16384 cached keys, 2-core AVX2 EPYC, median of 12
# interleaved: 46 / 84 / 135 / 283 ms native vs 62 / 90 / 124 / 236 ms widened.
UPCAST_MIN_QUERY_TILE = 128
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# The step's unembedding runs at least this many rows (zero rows padded; `gpt_oss.unembed`): XLA:CPU (jaxlib 0.10.2)
# lowers a dot with fewer rows to its own loop over a float32 copy of the bfloat16 table (gpt-oss-20b's 201088 × 2880:
# ~2 GB written per call; 215 ms for a 32768 × 1152 table), but an 8-row one to its bf16 GEMM library (15 ms,
# measured with benchmarks/breakdown.py's unembed part). Zero rows are cheap on every backend; the planner's compiled
# work (`plan.flops.per_device`) counts them.
UNEMBED_MIN_ROWS = 8
PREFIX_KV_WIDEN_MAX = 4  # `StepOptions.prefix_kv_tile_for`: a short prefix hit's wider key tile
# named scopes of the XLA attention core's key-tile loops per query tile (`attention._kv_tile_runs`): the masked runs
# before and after the run of whole tiles; `plan.hlo.matmul_flops` counts one pass of the three (the same dots)
MASKED_RUN_SCOPE, WHOLE_RUN_SCOPE = "kv_masked_run", "kv_whole_run"

# one line of help per field (the launcher defines one flag per field from these)
FIELD_HELP = {
    "q_tile": "Attention query tile (tokens).",
    "kv_tile": "Attention key/value tile (tokens).",
    "prefix_q_tile": "Query tile (tokens) of the attention over a reused prefix's cached keys.",
    "prefix_kv_tile": "Key/value tile (tokens) of the attention over a reused prefix's cached keys on full layers "
                      "(sliding layers keep kv_tile: they see at most window - 1 cached keys); 4x wider when a "
                      "hit's query tile is at most prefix_q_tile / 8 (64 new tokens at the defaults).",
    "moe_tile": "Rows per expert matmul tile: the loop MoE's tallest tile (each expert's last rows run in 4x and "
                "16x shorter tiles, none under 8 rows); the Pallas kernel caps it at 128.",
    "attention_impl": "Local attention core: auto = the fused Pallas kernel on GPUs (Triton) and the pure-JAX "
                      "blockwise reference elsewhere; pallas on CPU runs in interpret mode (slow, for testing); "
                      "cudnn = cuDNN's fused attention (NVIDIA GPUs, bf16/fp16) for a device's own causal block "
                      "of the prompt, pallas for the rest (ring blocks, a reused prefix's keys).",
    "moe_impl": "MoE grouped expert compute: loop = per-expert tile loop, ragged = jax.lax.ragged_dot, pallas = one "
                "grouped matmul kernel over expert-sorted row tiles with MXFP4 dequantized in the kernel (Triton on "
                "GPUs; interpret mode on CPU, slow, for testing); auto = loop (measured fastest on an H200 and the "
                "CPU; on GPUs pass --moe_tile=4096: 0.71x the 512-row tiles' time at 32K tokens).",
    "bf16_matmul": "How bfloat16 matmuls of the attention core (xla), the projections and the loop MoE run: native "
                   "= bf16 operands, float32 accumulation; float32 = operands widened to float32 first (the same "
                   "products, float32 accumulation; faster on CPUs without bf16 dot instructions); auto = float32 "
                   "on CPUs without AVX512_BF16/AMX-BF16 (x86) or BF16 (Arm), native elsewhere. No effect on "
                   "float32 models.",
    "ep_dispatch": "Expert-parallel dispatch: all_to_all = each token only to the devices that hold one of its "
                   "experts, in rounds of static capacity (dropless); all_gather = every token to every device of "
                   "the group; auto = all_to_all (plain all-to-alls: every backend).",
    "ep_capacity": "All-to-all dispatch: rows per (source, destination) pair and round, as a multiple of the "
                   "balanced share T_local*k/EP (capped at T_local); more rounds run when routing is skewed.",
}
CHOICES = {"attention_impl": ATTENTION_IMPLS, "moe_impl": MOE_IMPLS, "ep_dispatch": EP_DISPATCHES,
           "bf16_matmul": BF16_MATMULS}


def resolve_attention(impl: str, platform: str) -> str:
    """`attention_impl` → the concrete core: "auto" is "pallas" on GPUs (cuda, rocm) and "xla" elsewhere.
    Raises ValueError naming the field for an unknown value."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}: expected one of {ATTENTION_IMPLS}")
    if impl == "cudnn" and platform == "rocm":
        raise ValueError("attention_impl='cudnn' needs an NVIDIA GPU (cuDNN); on ROCm use 'pallas' or 'xla'")
    if impl != "auto":
        return impl
    return "pallas" if platform in GPU_PLATFORMS else "xla"


def resolve_moe(impl: str, platform: str) -> str:
    """`moe_impl` → the concrete grouped compute: "auto" is "loop" on every platform. Measured on an H200 (jax
    0.11.2, benchmarks/device_prefill.py, one gpt-oss-20b MoE layer, benchmarks/measured/h200/): the loop took
    10.3 / 26.6 ms at 8192 / 32768 tokens (8.8 / 18.9 ms with `moe_tile=4096`), the grouped MXFP4 Pallas kernel
    (`kernels.grouped_moe`: 64-wide weight tiles dequantized per row tile) 13.5 / 48.1 ms, and "ragged" 69.9 ms at 8192
    (XLA's GPU ragged_dot did dense work over all E experts); on the CPU the kernel only runs in interpret mode and
    ragged_dot is masked dense work. "pallas" and "ragged" stay selectable.
    Raises ValueError naming the field for an unknown value."""
    if impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl={impl!r}: expected one of {MOE_IMPLS}")
    return "loop" if impl == "auto" else impl


def resolve_bf16_matmul(choice: str, platform: str) -> str:
    """`bf16_matmul` → "native" or "float32": "auto" is "float32" on a CPU backend whose CPU has no bfloat16 dot
    instructions (`cpuinfo.has_bf16_dot`: no AVX512_BF16 / AMX-BF16 on x86, no BF16 on Arm) and "native" everywhere
    else (GPUs, TPUs, CPUs with them, CPUs whose flags are unknown).

    Why: XLA:CPU's GEMM library multiplies bfloat16 without such instructions by widening in its inner loop, slower
    than its float32 GEMM on operands widened once. Measured on a 2-core AVX2-only AMD EPYC (jaxlib 0.10.2, best of
    10): a `[R, 1152] × [1152, 2304]ᵀ` expert matmul ran at 64 / 83 / 88 GFLOP/s in bf16 and 75 / 105 / 113 GFLOP/s
    widened, at R = 32 / 128 / 512 rows; the peer config's whole prefill (one device, bf16 weights, KV and
    activations) of a 4096-token prompt took 6.7-7.2 s widened vs 9.2-10.4 s native (benchmarks/measured/cpu/
    README.md, 2026-12-04). On the AVX512_BF16 + AMX machine the CPU profile was calibrated on, XLA's bf16 GEMM ran
    at 2.0x its float32 rate (`configs/hardware/cpu.json: machine_reference`), so "native" stays there.
    The numbers are the same up to float32 summation order: a bfloat16 × bfloat16 product is exact in float32 and
    both accumulate in float32; what is rounded to bf16 between the matmuls (projections' outputs, the attention
    probabilities, the SwiGLU activations) is rounded in both. Raises ValueError naming the field for an unknown
    value."""
    if choice not in BF16_MATMULS:
        raise ValueError(f"bf16_matmul={choice!r}: expected one of {BF16_MATMULS}")
    if choice != "auto":
        return choice
    if platform != "cpu":
        return "native"
    from slope_jax import cpuinfo

    return "float32" if cpuinfo.has_bf16_dot() is False else "native"


def experts_read_from_stack(moe_impl: str) -> bool:
    """Whether the MoE compute `moe_impl` (resolved) reads one expert at a time straight from the layer stack
    (`model/stack.py`: "loop" does, so the layer loop leaves the expert weights stacked and copies none of them per
    layer); "ragged" and "pallas" take the layer's whole expert arrays. An unresolved "auto" is False (the
    conservative answer for the memory model)."""
    return moe_impl == "loop"


def resolve_ep_dispatch(dispatch: str, platform: str) -> str:
    """`ep_dispatch` → the concrete expert-parallel dispatch. "auto" is "all_to_all" on every backend: it is built from
    plain `all_to_all`s of static shapes in a loop of data-dependent trip count (`parallel.expert_parallel`), which
    XLA:CPU, GPU and TPU all run; `jax.lax.ragged_all_to_all` is not used because XLA:CPU does not implement it
    (jax 0.10.2: "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"). `platform` is accepted
    so that a backend where the gather measures faster can be switched here.
    Raises ValueError naming the field for an unknown value."""
    if dispatch not in EP_DISPATCHES:
        raise ValueError(f"ep_dispatch={dispatch!r}: expected one of {EP_DISPATCHES}")
    del platform
    return "all_to_all" if dispatch == "auto" else dispatch


def ep_rows(capacity: float, tokens_local: int, experts_per_token: int, expert_degree: int) -> int:
    """Static rows c per (source, destination) pair and round of the all-to-all expert dispatch:
    `min(T_local, ⌈capacity · T_local · k / EP⌉)`, at least 1 (T_local tokens per device, k experts per token, EP
    devices). A device sends a token at most once to each peer, so c = T_local always takes one round; under
    uniform routing a peer's expected share is ≤ T_local·k/EP rows."""
    share = capacity * tokens_local * experts_per_token / expert_degree
    return max(1, min(tokens_local, math.ceil(share - 1e-9)))  # 1e-9: an exact product's float rounding


MOE_KERNEL_MAX_TILE = 128  # rows: the Pallas MoE kernel's row tile (block_m) is `moe_tile` capped at this
MOE_LADDER_RATIO = 4  # each tile of the expert loop's ladder is this many times shorter than the one above
MOE_LADDER_MIN = 8  # rows: the ladder stops before a tile shorter than this
MOE_LADDER_HEIGHTS = 3  # at most this many heights (each one more traced and compiled loop per step program)


def moe_loop_tiles(tile: int, assignments: int) -> tuple[int, ...]:
    """Tile heights (rows) of the "loop" MoE's ladder (`model.moe.experts`): the expert's group runs tiles of the
    first height, then of each next one, its last rows in tiles of the last height (how many of each:
    `moe_loop_rows`).

    The first height is `tile` (`StepOptions.moe_tile`) clipped to `assignments` (T·k); each next one is
    `MOE_LADDER_RATIO` times shorter, down to `MOE_LADDER_MIN` rows, at most `MOE_LADDER_HEIGHTS` heights:
    512 → (512, 128, 32), 128 → (128, 32, 8), 32 → (32, 8), 16 → (16,). An expert group's rows go to the tallest
    tiles that `moe_loop_rows` allows: fewer pad rows than the second height (≤ 127 at the default, ≤ 31 in the
    shortest tiles; one height of 128 padded up to 127 and ran ~152 rows per expert as 256 at 600 tokens, top-4 of
    16 experts); the tall tiles keep the matmuls efficient. Each height is one more loop to trace, lower and compile
    in every step program (what a compilation-cache hit still pays), hence the cap. Measured on the peer config's
    MoE layer (2 idle CPU cores, bf16): `benchmarks/moe_ladder.py`, the README's performance section. JAX-free;
    `plan.flops.moe_rows` counts the same rows.

    Raises ValueError for a tile or an assignment count below 1.
    """
    if tile < 1 or assignments < 1:
        raise ValueError(f"moe_tile={tile}, assignments={assignments}: both must be >= 1")
    out = [min(tile, assignments)]
    while out[-1] // MOE_LADDER_RATIO >= MOE_LADDER_MIN and len(out) < MOE_LADDER_HEIGHTS:
        out.append(out[-1] // MOE_LADDER_RATIO)
    return tuple(out)


def moe_loop_slack(tiles: tuple[int, ...], j: int) -> int:
    """Rows added to what is left before height `tiles[j]` divides it (`moe_loop_rows`): `tiles[j + 1] − 1`, so that
    one more tile runs when it would pad fewer rows than the next height; `tiles[j] − 1` (a ceiling) at the last."""
    return (tiles[j + 1] if j < len(tiles) - 1 else tiles[j]) - 1


def moe_loop_rows(count: int, tiles: tuple[int, ...]) -> dict[int, int]:
    """Rows by tile height, `{height: rows}`, that the ladder `tiles` (`moe_loop_tiles`) runs for an expert group of
    `count` assignments. Each height but the last runs the whole tiles the rows left fill, and one more tile when
    the rows left after those would pad it by fewer than the next height's rows (then nothing is left for the
    shorter heights); the last height runs ⌈rest / last⌉ tiles (one height: ⌈count / tile⌉). Pad rows: fewer than
    `tiles[1]` (`tiles[0]` for one height). Why round up: a 512-row tile of the peer config's bf16 expert matmul
    took 23 µs a row on 2 CPU cores, 128-row ones 27 µs and 32-row ones 34 µs, so 490 rows ran in 12 ms as one
    padded 512-row tile and in 15 ms as 3×128 + 4×32; one MoE layer at 2048 tokens took 0.85–0.92× the time of
    the ladder without it (interleaved, best of 12; neutral at 608 and 8192 tokens). Iterations of a height: its
    rows / height. JAX-free mirror of `model.moe.experts` (`plan.flops.moe_rows` sums it over experts)."""
    out = dict.fromkeys(tiles, 0)
    left = count
    for j, size in enumerate(tiles):
        n = max(left + moe_loop_slack(tiles, j), 0) // size
        out[size] += n * size
        left -= n * size
    return out


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Compute options of the compiled step.

    q_tile, kv_tile: attention query / key tile (tokens; clipped to the lengths, the Pallas kernel also caps them).
    prefix_q_tile, prefix_kv_tile: the tiles of a prefix hit's attention over the cached keys
      (`context_parallel.prefix_attention`; sliding layers keep kv_tile). Tall query tiles, short key tiles: each
      key tile's float32 scores (K·G·q·kv entries) then stay in the cores' caches through the elementwise passes
      (mask, max, exp, sum, the bf16 probabilities), which bound this attention on XLA:CPU, and the last tile of a
      prefix that does not fill its capacity pads at most kv − 1 rows (tiles with no cached key are skipped). 442
      new tokens over 8576 cached, one CPU device of the peer config (2 cores, bf16): one full layer's cached-key
      attention 98 ms at 512 × 256 vs 160 ms at 512 × 2048 and 141 ms at 256 × 1024; the whole hit 0.87× as long
      alternated in one process (`benchmarks/prefix_tile_ab.py`; a hit of ~100 new tokens over 16K, whose
      attention is a smaller share, within the scatter). Short key tiles lose only for a handful of queries (16 over
      16384: 18 vs 15 ms). benchmarks/measured/cpu/README.md, fifth session. A hit of a handful of new tokens
      (query tile <= prefix_q_tile / 8) takes 4x wider key tiles on full layers: `prefix_kv_tile_for`.
    moe_tile: rows per expert matmul tile (clipped to tokens × experts_per_token): the "loop" MoE's tallest tile, it
      ends each expert's group with shorter ones (`moe_loop_tiles`); the Pallas kernel pads each group to whole tiles
      of this height capped at `MOE_KERNEL_MAX_TILE`. Default 512: on 2 CPU cores a 512-row bf16 expert matmul of the
      peer config ran at 1.2–1.3× the FLOP rate of a 128-row one in quiet runs (`benchmarks/moe_ladder.py`).
    attention_impl: "auto" | "pallas" | "xla" (`model.attention.attend`); moe_impl: "auto" | "ragged" | "loop" |
      "pallas" (`model.moe.experts`). The step runs only resolved options (`resolve`).
    bf16_matmul: "auto" | "native" | "float32": how the bf16 matmuls of the XLA attention core, the projections and
      the loop MoE run (`resolve_bf16_matmul`; `upcast_matmul`); the router, the unembedding and the GPU kernels
      (pallas, cudnn, ragged) stay native.
    ep_dispatch: "auto" | "all_to_all" | "all_gather" (`parallel.expert_parallel`); ep_capacity: the all-to-all's
      rows per peer and round over the balanced share (`ep_rows`), a float > 0.
    Raises ValueError naming the field: a tile that is not a positive int, an unknown implementation, a capacity
    that is not a positive finite number.
    """

    q_tile: int = 256
    kv_tile: int = 256
    prefix_q_tile: int = 512
    prefix_kv_tile: int = 256
    moe_tile: int = 512
    attention_impl: str = "auto"
    moe_impl: str = "auto"
    ep_dispatch: str = "auto"
    ep_capacity: float = 1.25
    bf16_matmul: str = "auto"

    def __post_init__(self):
        for name in ("q_tile", "kv_tile", "prefix_q_tile", "prefix_kv_tile", "moe_tile"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer (tokens)")
        c = self.ep_capacity
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
            raise ValueError(f"ep_capacity={c!r}: must be a positive finite number (multiple of T_local*k/EP)")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected one of {choices}")

    def resolve(self, platform: str | None = None) -> StepOptions:
        """The same options with "auto" replaced by the concrete choice for `platform` ("cpu", "gpu", "cuda", "rocm",
        "tpu"; default: JAX's default backend). THE one place "auto" is decided; idempotent."""
        if platform is None:
            import jax  # only here: the module stays importable without JAX

            platform = jax.default_backend()
        return dataclasses.replace(self, attention_impl=resolve_attention(self.attention_impl, platform),
                                   moe_impl=resolve_moe(self.moe_impl, platform),
                                   ep_dispatch=resolve_ep_dispatch(self.ep_dispatch, platform),
                                   bf16_matmul=resolve_bf16_matmul(self.bf16_matmul, platform))

    @property
    def resolved(self) -> bool:
        return "auto" not in (self.attention_impl, self.moe_impl, self.ep_dispatch, self.bf16_matmul)

    @property
    def upcast_matmul(self) -> bool:
        """Whether bf16 matmul operands are widened to float32 (`bf16_matmul` resolved to "float32")."""
        return self.bf16_matmul == "float32"

    def prefix_kv_tile_for(self, queries: int) -> int:
        """Key tile (tokens) of a prefix hit's attention over its cached keys on full layers, for `queries` new
        tokens per device: `prefix_kv_tile`, times PREFIX_KV_WIDEN_MAX when the query tile is at most 1/8 of
        prefix_q_tile (64 new tokens at the defaults), where tiny score tiles pay the key loop's per-tile cost.
        Measured on 2 AVX2 cores, peer config, bf16, one device: one full layer's cached-key attention of 56 queries
        over 16384 keys 128 ms at 256-key tiles, 84 ms at 1024, 113 ms at 4096 (448 queries: 654 / 658 / 750 ms); the
        whole hit alternated in one process (`benchmarks/prefix_tile_ab.py`): 56 new tokens over 16384, median 794 ms
        at 1024-key tiles vs 869 ms at 256; 100 new (query tile 128), 1081 vs 1054 ms (scatter 837–1419), so tiles
        of 128 queries keep 256 keys. benchmarks/measured/cpu/README.md, 2026-12-04."""
        bq = max(1, min(self.prefix_q_tile, queries))
        return self.prefix_kv_tile * (PREFIX_KV_WIDEN_MAX if 8 * bq <= self.prefix_q_tile else 1)

    def ep_rows(self, tokens_local: int, experts_per_token: int, expert_degree: int) -> int:
        """`ep_rows` with this `ep_capacity`."""
        return ep_rows(self.ep_capacity, tokens_local, experts_per_token, expert_degree)

    def require_resolved(self) -> StepOptions:
        """self; raises ValueError when an implementation is still "auto" (a step must be built from `resolve`d
        options, so that what is logged and fingerprinted is what runs)."""
        if not self.resolved:
            raise ValueError(f"{self}: attention_impl/moe_impl/ep_dispatch/bf16_matmul 'auto' must be resolved first "
                             "(StepOptions.resolve)")
        return self

    def to_dict(self) -> dict:
        """Field name → value (JSON-ready; `StepOptions(**d)` round-trips)."""
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))
