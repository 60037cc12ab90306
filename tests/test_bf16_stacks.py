"""No compiled step re-writes a bf16 stack as float32 (`slope_jax/model/stack.py`, `plan.hlo.widened_copies`).

XLA:CPU runs a dynamic slice, dynamic update or gather of bf16 through float32 and hoists the convert of the whole
operand out of the loop around it: a layer's cached prefix sliced in the layer scan re-wrote the whole `[L, S, K, H]`
cache as float32 and back on every hit (~100 ms of a 16K-token hit's ~400 ms, peer config), the map over a step's
prompts the whole embedding table and K/V outputs. The step's loops slice bits instead (`stack.bits`), and the
engine hands cached K/V over as bits (`serve.reuse.step_kv_dtype`).
"""

import jax
import jax.numpy as jnp
import pytest
from support import TILES

from slope_jax.model import stack
from slope_jax.parallel.config import ParallelConfig
from slope_jax.plan import hlo
from slope_jax.serve.engine import PrefillEngine

# CONFIG_A: K·H = 48 per token; the smallest stack slice that matters, one layer's K of a 128-token bucket, has
# 6144 elements; its [L, D] norm stacks (256, used in float32 by design) and head-sized vectors stay below this.
MIN_ELEMENTS = 1024


def test_detector_sees_a_widened_stack():
    """Positive control: a bf16 stack indexed (or scanned) in a loop is widened whole; sliced as bits it is not."""
    a = jax.ShapeDtypeStruct((6, 256, 48), jnp.bfloat16)

    def indexed(a):
        return jax.lax.map(lambda i: (a[i] * 2).sum(), jnp.arange(6))

    def scanned(a):
        return jax.lax.scan(lambda c, x: (c + x.astype(jnp.float32).sum(), None), 0.0, a)[0]

    def as_bits(a):
        return jax.lax.map(lambda i: (stack.take(a, i) * 2).sum(), jnp.arange(6))

    def text(f):
        return jax.jit(f).lower(a).compile().as_text()

    for f in (indexed, scanned):
        assert any("f32[6,256,48]" in line for line in hlo.widened_copies(text(f), min_elements=MIN_ELEMENTS)), f
    assert hlo.widened_copies(text(as_bits), min_elements=MIN_ELEMENTS) == []


@pytest.mark.parametrize("parallel", [
    ParallelConfig(), ParallelConfig(pipeline=2, ring=2, seq_chunks=2), ParallelConfig(ring=3, ulysses=2, expert=6),
], ids=["1dev", "P2xR2xC2", "R3xU2xE6"])
def test_steps_widen_no_bf16_stack(checkpoints, parallel):
    """Cold and prefix-reuse steps of two prompts, one device (layer scan, per-prompt map, embedding gather),
    pipeline × ring with sequence chunks (stage stacks, chunk buffers, cached prefix, vocabulary-parallel embedding)
    and Ulysses × ring with expert parallelism (dispatch rounds): no float32 copy of a bf16 input or output, whole or
    sliced."""
    devices = jax.devices()[:parallel.num_devices] if parallel.num_devices > 1 else None
    eng = PrefillEngine.from_checkpoint(checkpoints["A"]["dense"], parallel, dtype="bfloat16", progress=False,
                                        devices=devices, bf16_matmul="native", **TILES)
    # (bucket, cached-prefix rows) of a cold prompt and a hit; no bucket equals a device's 112 vocabulary rows (448 /
    # 4 under P2×R2), whose [rows, D] shape the float32 sums of the vocabulary-parallel embedding would then match
    for key in (eng.step_key(100), eng.step_key(346, cached=256)):
        found = hlo.widened_copies(eng.compiled(key[0], 2, key[1]).as_text(), min_elements=MIN_ELEMENTS)
        assert found == [], (key, found)
