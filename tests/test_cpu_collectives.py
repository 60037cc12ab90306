"""Collectives on XLA:CPU (jaxlib 0.10.2): every collective is lowered with channel id 1, and XLA:CPU keys a
collective's rendezvous by (run, devices, kind, channel id), so two collectives of one kind over the same devices
that its thunk executor runs concurrently meet in one rendezvous and abort the process (outside-in probe: a prefix
hit on ring ≥ 4 aborted in 3 of 3 runs; `collectives._serialize_collectives`). The prefix ring's (q, positions,
state), the ring's K/V blocks and the halo's three pieces now go one collective at a time."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from support import REPO

from slope_jax.checkpoints import writer as checkpoint_writer
from slope_jax.model.config import FULL, SLIDING, ModelConfig
from slope_jax.parallel import collectives

CHILD = r"""
import os, sys
os.environ["SLOPE_JAX_COMPILE_CACHE"] = "off"  # compile here: the fault is in running what XLA just built
import jax, numpy as np
from slope_jax.kv.prefix import ReuseOptions
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine
ring, ckpt = int(sys.argv[1]), sys.argv[2]
eng = PrefillEngine.from_checkpoint(ckpt, ParallelConfig(ring=ring, ulysses=1), dtype="float32", progress=False,
                                    devices=jax.devices()[:ring], reuse=ReuseOptions(block_size=48), q_tile=16,
                                    kv_tile=24, prefix_q_tile=32, prefix_kv_tile=40, moe_tile=16)
prompt = np.random.default_rng(3).integers(5, 1000, 195).astype(np.int32)
cold = eng.prefill([prompt], prefix_reuse=False)[0]
eng.prefill([prompt])
for _ in range(3):
    hit = eng.prefill([prompt])[0]
    assert hit.cached_tokens == 192 and hit.first_token == cold.first_token, hit.cached_tokens
    assert np.abs(hit.logits - cold.logits).max() < 2e-5
print("ok")
"""


def test_ppermute_packed_is_one_bit_exact_collective():
    """A pytree of bf16, int32 and float32 leaves: the same values as one ppermute per leaf, in one
    collective-permute of the compiled program."""
    mesh = Mesh(jax.devices()[:4], ("r",))
    perm = [(i, (i + 1) % 4) for i in range(4)]
    rng = np.random.default_rng(0)
    tree = (jnp.asarray(rng.normal(size=(4 * 3, 5)), jnp.bfloat16), jnp.arange(4 * 7, dtype=jnp.int32),
            jnp.asarray(rng.normal(size=(4 * 2, 2, 3)), jnp.float32))

    def run(fn):
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("r"),), out_specs=P("r")))
        return f(tree), f.lower(tree).compile().as_text().count("collective-permute(")

    got, n_packed = run(lambda t: collectives.ppermute_packed(t, "r", perm))
    want, n_plain = run(lambda t: jax.tree.map(lambda a: jax.lax.ppermute(a, "r", perm), t))
    assert (n_packed, n_plain) == (1, 3)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w))  # bit-exact


# the probe's held-out config (pairwise-distinct sizes, 5 layers, window 96 < the 195-token prompt)
PROBE_CONFIG = ModelConfig(
    num_hidden_layers=5, num_experts=5, experts_per_token=2, vocab_size=1031, hidden_size=160, intermediate_size=224,
    num_attention_heads=12, num_key_value_heads=3, head_dim=48, sliding_window=96,
    layer_types=(FULL, SLIDING, SLIDING, FULL, SLIDING), eos_token_ids=(1030,), pad_token_id=1029)


def test_a_prefix_hit_on_a_ring_of_four_runs_to_the_end(tmp_path):
    """The probe's case: a 195-token prompt cold, stored, then hit three times (192 cached tokens, 48-token blocks)
    on ring 4, in a fresh process with the compilation cache off. It aborted inside XLA:CPU's rendezvous."""
    ckpt = str(tmp_path / "ckpt")
    checkpoint_writer.write_hf(ckpt, PROBE_CONFIG, checkpoint_writer.random_params(PROBE_CONFIG, seed=11),
                               experts="mxfp4")
    env = {**os.environ, "PYTHONPATH": REPO, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
    r = subprocess.run([sys.executable, "-c", CHILD, "4", ckpt], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
