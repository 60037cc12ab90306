"""On-device parity of the Pallas flash-attention kernel against the pure-JAX reference (`attention.attend`).

    PYTHONPATH=. python3 benchmarks/kernel_parity.py --out /tmp/kernel_parity.json

The CPU test suite checks the kernel in interpret mode (tests/test_flash_attention.py); this runs the compiled
kernel (Triton on GPUs) on the same classes of cases at device-sized blocks: causal, sliding windows around the length,
fully masked rows, GQA 64/8 and 12/4, a ring step continuing a state, a halo block, lengths no block divides — in
float32 (matmul precision "highest") and bfloat16 inputs. Prints max |Δ| of the finalised outputs and writes JSON;
exit status 1 if a float32 case exceeds `--tol`.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "benchmarks/results/kernel_parity.json", "JSON output path.")
flags.DEFINE_float("tol", 1e-5, "float32 tolerance on the finalised output (max |Δ|).")


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from slope_jax.atomic import atomic_json
    from slope_jax.model import attention as attn

    jax.config.update("jax_default_matmul_precision", "highest")
    inv = attn.INVALID_POS

    def qkv(tq, tk, n, kh, d, seed, dtype):
        r = np.random.default_rng(seed)
        return tuple(jnp.asarray(r.standard_normal(s), dtype) for s in ((tq, n, d), (tk, kh, d), (tk, kh, d)))

    def arange(a, b):
        return jnp.arange(a, b, dtype=jnp.int32)

    cases = {  # name: (tq, tk, n, kh, q_pos, k_pos, window, state_from)
        "causal_64_8_T1000": (1000, 1000, 64, 8, arange(0, 1000), arange(0, 1000), attn.NO_WINDOW),
        "causal_12_4_T333": (333, 333, 12, 4, arange(0, 333), arange(0, 333), attn.NO_WINDOW),
        "sliding_W127_T128": (128, 128, 64, 8, arange(0, 128), arange(0, 128), 127),
        "sliding_W128_T128": (128, 128, 64, 8, arange(0, 128), arange(0, 128), 128),
        "sliding_W129_T700": (700, 700, 64, 8, arange(0, 700), arange(0, 700), 129),
        "masked_rows": (300, 260, 12, 4, jnp.concatenate([arange(0, 100), arange(400, 560), jnp.full((40,), inv)]),
                        jnp.concatenate([jnp.full((100,), inv), arange(300, 460)]), 130),
        "halo_block": (256, 383, 64, 8, arange(1000, 1256), arange(873, 1256), 128),
    }
    rows = {}
    ok = True
    for dtype in (jnp.float32, jnp.bfloat16):
        for name, (tq, tk, n, kh, qp, kp, w) in cases.items():
            key = f"{name}/{jnp.dtype(dtype).name}"
            try:
                q, k, v = qkv(tq, tk, n, kh, 64, len(name), dtype)
                sinks = jnp.linspace(-1.0, 1.0, n)
                t0 = time.perf_counter()
                b = attn.attend(q, k, v, qp, kp, window=w, impl="pallas")
                jax.block_until_ready(b)
                dt = time.perf_counter() - t0
                a = attn.attend(q, k, v, qp, kp, window=w, impl="xla")
                err = float(jnp.abs(attn.finalize(a, sinks) - attn.finalize(b, sinks)).max())
                finite = bool(jnp.isfinite(b.o).all() and jnp.isfinite(b.l).all())
                same_empty = bool((jnp.isneginf(a.m) == jnp.isneginf(b.m)).all())
                # ring step: continue the kernel's own state with a second block of later keys
                st = attn.attend(q, k, v, qp + tk, kp + tk, window=w, impl="pallas",
                                 state=attn.attend(q, k, v, qp, kp, window=w, impl="pallas"))
                st_ref = attn.attend(q, k, v, qp + tk, kp + tk, window=w, impl="xla", state=a)
                err_ring = float(jnp.abs(attn.finalize(st, sinks) - attn.finalize(st_ref, sinks)).max())
                rows[key] = {"max_abs_diff": err, "ring_continuation_max_abs_diff": err_ring, "finite": finite,
                             "same_empty_rows": same_empty, "first_call_s": dt}
                bad = not (finite and same_empty) or (dtype == jnp.float32 and max(err, err_ring) > FLAGS.tol)
                ok &= not bad
                print(f"{key:<32} max|Δ| {err:.2e}  ring {err_ring:.2e}  finite {finite}  empty rows match "
                      f"{same_empty}{'  FAIL' if bad else ''}", flush=True)
            except Exception as e:  # noqa: BLE001 - record and continue
                ok = False
                rows[key] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
                print(f"{key:<32} ERROR {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                      flush=True)
    doc = {"jax": jax.__version__, "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
           "tol_f32": FLAGS.tol, "ok": ok, "cases": rows}
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    atomic_json(FLAGS.out, doc)
    print(f"kernel parity {'ok' if ok else 'FAILED'}; wrote {FLAGS.out}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    app.run(main)
