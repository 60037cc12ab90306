"""On-device parity of the fused kernels against the pure-JAX references: cuDNN's fused attention (`sdpa`:
`attention.attend`, impl "cudnn" on contiguous blocks, bf16 only, alone and after a prefix's state), the Pallas flash
attention (impl "pallas" vs "xla") and the grouped MXFP4 MoE (`moe.moe`, impl "pallas" vs "loop").

    PYTHONPATH=. python3 benchmarks/kernel_parity.py --out /tmp/kernel_parity.json          # GPU
    PYTHONPATH=. python3 benchmarks/kernel_parity.py --smoke --out /tmp/kernel_parity.json  # CPU dry run, tiny

The CPU test suite checks both kernels in interpret mode (tests/test_flash_attention.py); this runs the compiled
kernels (Triton on GPUs) on the same classes of cases at device-sized blocks. Attention: causal, sliding windows
around the length, fully masked rows, GQA 64/8 and 12/4 (G = 3: padded to 4 on the GPU), a ring step continuing a
state, a halo block, lengths no block divides. MoE: gpt-oss-20b widths (E = 32, D = I = 2880, k = 4) with random
MXFP4 experts, router-driven and skewed routing (one expert takes every token), pad tokens. Each in float32 (matmul
precision "highest": Triton dots in IEEE float32) and bfloat16 inputs. Prints max |Δ| and writes the JSON after
every case (atomically); a case that would start after `--budget_s` is skipped and recorded. Exit status 1 if a
float32 case exceeds its tolerance (`--tol` for attention outputs; for the MoE `--tol` relative to max(1, max|ref|),
the float32 summation order over D = 2880 differs) or fails.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import start_load, write_result  # noqa: E402  (benchmarks/common.py)

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "benchmarks/results/kernel_parity.json", "JSON output path.")
flags.DEFINE_float("tol", 1e-5, "float32 tolerance (attention: max |Δ| of the finalised output; MoE: max |Δ| / "
                   "max(1, max |reference|)).")
flags.DEFINE_float("budget_s", 150.0, "Cases that would start after this many seconds are skipped.")
flags.DEFINE_bool("smoke", False, "Tiny shapes in interpret mode (CPU): checks the script, not the device.")
flags.DEFINE_list("parts", ["sdpa", "attention", "moe"], "Which kernels to check (sdpa: attention_impl "
                  "\"cudnn\", cuDNN's fused attention).")


def attention_cases(smoke: bool) -> dict:
    import jax.numpy as jnp

    from slope_jax.model import attention as attn

    inv = attn.INVALID_POS

    def arange(a, b):
        return jnp.arange(a, b, dtype=jnp.int32)

    if smoke:
        return {"causal_12_4_T45": (45, 45, 12, 4, arange(0, 45), arange(0, 45), attn.NO_WINDOW),
                "sliding_W9_T37": (37, 37, 16, 4, arange(0, 37), arange(0, 37), 9)}
    return {  # name: (tq, tk, n, kh, q_pos, k_pos, window)
        "causal_64_8_T1000": (1000, 1000, 64, 8, arange(0, 1000), arange(0, 1000), attn.NO_WINDOW),
        "causal_12_4_T333": (333, 333, 12, 4, arange(0, 333), arange(0, 333), attn.NO_WINDOW),
        "sliding_W127_T128": (128, 128, 64, 8, arange(0, 128), arange(0, 128), 127),
        "sliding_W128_T128": (128, 128, 64, 8, arange(0, 128), arange(0, 128), 128),
        "sliding_W129_T700": (700, 700, 64, 8, arange(0, 700), arange(0, 700), 129),
        "masked_rows": (300, 260, 12, 4, jnp.concatenate([arange(0, 100), arange(400, 560), jnp.full((40,), inv)]),
                        jnp.concatenate([jnp.full((100,), inv), arange(300, 460)]), 130),
        "halo_block": (256, 383, 64, 8, arange(1000, 1256), arange(873, 1256), 128),
    }


def check_attention(name, case, dtype, smoke):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.model import attention as attn

    tq, tk, n, kh, qp, kp, w = case
    d = 16 if smoke else 64
    r = np.random.default_rng(len(name))
    q, k, v = (jnp.asarray(r.standard_normal(s), dtype) for s in ((tq, n, d), (tk, kh, d), (tk, kh, d)))
    sinks = jnp.linspace(-1.0, 1.0, n)
    tiles = dict(q_tile=16, kv_tile=16) if smoke else {}
    t0 = time.perf_counter()
    b = attn.attend(q, k, v, qp, kp, window=w, impl="pallas", **tiles)
    jax.block_until_ready(b)
    dt = time.perf_counter() - t0
    a = attn.attend(q, k, v, qp, kp, window=w, impl="xla", **tiles)
    err = float(jnp.abs(attn.finalize(a, sinks) - attn.finalize(b, sinks)).max())
    finite = bool(jnp.isfinite(b.o).all() and jnp.isfinite(b.l).all())
    same_empty = bool((jnp.isneginf(a.m) == jnp.isneginf(b.m)).all())
    # ring step: continue the kernel's own state with a second block of later keys
    st = attn.attend(q, k, v, qp + tk, kp + tk, window=w, impl="pallas", **tiles,
                     state=attn.attend(q, k, v, qp, kp, window=w, impl="pallas", **tiles))
    st_ref = attn.attend(q, k, v, qp + tk, kp + tk, window=w, impl="xla", state=a, **tiles)
    err_ring = float(jnp.abs(attn.finalize(st, sinks) - attn.finalize(st_ref, sinks)).max())
    row = {"max_abs_diff": err, "ring_continuation_max_abs_diff": err_ring, "finite": finite,
           "same_empty_rows": same_empty, "first_call_s": dt}
    bad = not (finite and same_empty) or (dtype == jnp.float32 and max(err, err_ring) > FLAGS.tol)
    msg = f"max|Δ| {err:.2e}  ring {err_ring:.2e}  finite {finite}  empty rows match {same_empty}"
    return row, bad, msg


def sdpa_cases(smoke: bool) -> dict:
    # name: (T, n, kh, window, prefix tokens before the block): contiguous self-attention blocks (`contiguous=True`)
    if smoke:
        return {"causal_12_4_T45": (45, 12, 4, None, 0), "sliding_W9_T37_prefix11": (37, 16, 4, 9, 11)}
    return {"causal_64_8_T1000": (1000, 64, 8, None, 0), "sliding_W128_T1000": (1000, 64, 8, 128, 0),
            "sliding_W129_T700_prefix300": (700, 64, 8, 129, 300), "causal_12_4_T333_prefix77": (333, 12, 4, None, 77),
            "causal_64_8_T4096": (4096, 64, 8, None, 0)}


def check_sdpa(name, case, dtype, smoke):
    """attention_impl "cudnn" (cuDNN's fused attention; JAX's XLA version of the call on the CPU) vs the blockwise
    reference on the same inputs, alone and continuing a prefix's state. Half precision only (cuDNN's rule): the
    float32 rows are skipped; a bf16 error above 5e-2 (a wrong log-sum-exp convention shows as O(0.1–1)) fails."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.model import attention as attn

    if dtype == jnp.float32:
        return {"skipped": "cuDNN's fused attention takes bf16/fp16 only"}, False, "skipped (float32)"
    if jax.default_backend() != "cpu" and attn.on_rocm():
        return {"skipped": "cuDNN's fused attention: NVIDIA GPUs only"}, False, "skipped (ROCm)"
    t, n, kh, w, off = case
    w = attn.NO_WINDOW if w is None else w
    d = 16 if smoke else 64
    r = np.random.default_rng(len(name))
    q, k, v = (jnp.asarray(r.standard_normal(s), dtype) for s in ((t, n, d), (t, kh, d), (t, kh, d)))
    kp_, vp_ = (jnp.asarray(r.standard_normal((max(off, 1), kh, d)), dtype) for _ in range(2))
    pos = jnp.arange(t, dtype=jnp.int32) + off
    ppos = jnp.arange(max(off, 1), dtype=jnp.int32) if off else jnp.full((1,), attn.INVALID_POS, jnp.int32)
    sinks = jnp.linspace(-1.0, 1.0, n)

    @jax.jit  # inputs as arguments: XLA constant-folds a closed-over input, and its CPU evaluator of the blockwise
    # reference gave O(1) errors at T = 1000 (jaxlib 0.10.2 and 0.11.2; the compiled program is exact)
    def both(window, q, k, v, kp_, vp_):
        st0 = attn.attend(q, kp_, vp_, pos, ppos, window=window, impl="xla")
        ref = attn.attend(q, k, v, pos, pos, window=window, state=st0, impl="xla")
        got = attn.attend(q, k, v, pos, pos, window=window, state=st0, impl="cudnn", contiguous=True,
                          windows=(w, attn.NO_WINDOW) if w != attn.NO_WINDOW else (w,))
        return attn.finalize(ref, sinks), attn.finalize(got, sinks)

    t0 = time.perf_counter()
    ref, got = jax.block_until_ready(both(jnp.int32(w), q, k, v, kp_, vp_))
    dt = time.perf_counter() - t0
    err = float(jnp.abs(ref - got).max())
    finite = bool(jnp.isfinite(got).all())
    entry = attn.SDPA_ENTRY.get("cudnn" if jax.default_backend() in ("gpu", "cuda") else "xla")
    row = {"max_abs_diff": err, "finite": finite, "entry": entry, "first_call_s": dt}
    bad = not finite or err > 5e-2
    return row, bad, f"max|Δ| {err:.2e}  finite {finite}  entry {entry}"


def moe_cases(smoke: bool) -> dict:
    # name: (E, D, I, k, T, valid tokens, skew)
    if smoke:
        return {"E6_D64_I96_T53": (6, 64, 96, 2, 53, 47, False), "skew_E5_D96_I64_T40": (5, 96, 64, 3, 40, 40, True)}
    return {"20b_T1000": (32, 2880, 2880, 4, 1000, 937, False), "20b_skew_T700": (32, 2880, 2880, 4, 700, 700, True)}


def check_moe(name, case, dtype, smoke):
    import jax
    import jax.numpy as jnp

    from slope_jax.model import moe

    e, d, i, k, t, n_valid, skew = case
    ks = jax.random.split(jax.random.key(len(name)), 9)
    p = {"router_w": jax.random.normal(ks[0], (e, d), jnp.float32) * 0.05,
         "router_b": jax.random.normal(ks[1], (e,), jnp.float32) * 0.1,
         "b1": jax.random.normal(ks[2], (e, 2 * i), jnp.float32) * 0.05,
         "b2": jax.random.normal(ks[3], (e, d), jnp.float32) * 0.05,
         # random E2M1 codes, scale bytes 118..121 (2^-9..2^-6)
         "w1_blocks": jax.random.randint(ks[4], (e, 2 * i, d // 32, 16), 0, 256).astype(jnp.uint8),
         "w1_scales": jax.random.randint(ks[5], (e, 2 * i, d // 32), 118, 122).astype(jnp.uint8),
         "w2_blocks": jax.random.randint(ks[6], (e, d, i // 32, 16), 0, 256).astype(jnp.uint8),
         "w2_scales": jax.random.randint(ks[7], (e, d, i // 32), 118, 122).astype(jnp.uint8)}
    if skew:  # every token's top-1 is expert 3, top-2 expert 1, …: one group holds all T rows
        p["router_w"] = jnp.zeros_like(p["router_w"])
        p["router_b"] = -jnp.arange(e, dtype=jnp.float32).at[3].set(5.0)
    p = {n: (v.astype(dtype) if n in ("b1", "b2") else v) for n, v in p.items()}
    h = jax.random.normal(ks[8], (t, d), jnp.float32).astype(dtype)
    valid = jnp.arange(t) < n_valid
    kw = dict(experts_per_token=k, alpha=1.702, limit=7.0, tile=16 if smoke else 128)
    t0 = time.perf_counter()
    b = jax.jit(lambda h: moe.moe(h, valid, p, impl="pallas", **kw))(h)
    jax.block_until_ready(b)
    dt = time.perf_counter() - t0
    a = jax.jit(lambda h: moe.moe(h, valid, p, impl="loop", **kw))(h)
    scale = max(1.0, float(jnp.abs(a).max()))
    err = float(jnp.abs(a - b)[:n_valid].max()) / scale
    finite = bool(jnp.isfinite(b).all())
    pads_zero = bool((b[n_valid:] == 0).all())
    row = {"max_abs_diff_over_scale": err, "scale": scale, "finite": finite, "pad_tokens_zero": pads_zero,
           "first_call_s": dt}
    bad = not (finite and pads_zero) or (dtype == jnp.float32 and err > FLAGS.tol)
    return row, bad, f"max|Δ|/max(1,|ref|) {err:.2e} (scale {scale:.2f})  finite {finite}  pads zero {pads_zero}"


def main(argv):
    del argv
    load0 = start_load()
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_default_matmul_precision", "highest")
    t_start = time.perf_counter()
    doc = {"jax": jax.__version__, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
           "smoke": FLAGS.smoke, "tol_f32": FLAGS.tol, "ok": True, "cases": {}, "skipped": []}
    parts = {"attention": (attention_cases, check_attention), "moe": (moe_cases, check_moe),
             "sdpa": (sdpa_cases, check_sdpa)}
    for part in FLAGS.parts:
        cases, check = parts[part]
        for dtype in (jnp.float32, jnp.bfloat16):
            for name, case in cases(FLAGS.smoke).items():
                key = f"{part}/{name}/{jnp.dtype(dtype).name}"
                if time.perf_counter() - t_start > FLAGS.budget_s:
                    doc["skipped"].append(key)
                    print(f"{key:<40} skipped: {FLAGS.budget_s:.0f} s budget spent", flush=True)
                    continue
                try:
                    row, bad, msg = check(name, case, dtype, FLAGS.smoke)
                except Exception as e:  # noqa: BLE001 - record and continue
                    row, bad = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}, True
                    msg = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                doc["cases"][key] = row
                doc["ok"] &= not bad
                print(f"{key:<40} {msg}{'  FAIL' if bad else ''}", flush=True)
                write_result(FLAGS.out, doc, load_start=load0)
    doc["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    write_result(FLAGS.out, doc, load_start=load0)
    print(f"kernel parity {'ok' if doc['ok'] else 'FAILED'}; wrote {FLAGS.out}", flush=True)
    sys.exit(0 if doc["ok"] else 1)


if __name__ == "__main__":
    app.run(main)
