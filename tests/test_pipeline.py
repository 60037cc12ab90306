"""Pipeline parallelism combined with context parallelism: stage split, sharded parameters, GPipe schedule,
results equal to the single-device path. CONFIG_B has 9 layers, so stages hold odd layer counts."""

import numpy as np
import pytest
from support import CONFIG_B, CONFIGS, random_prompt

from slope_jax.checkpoints import hf as ckpt_lib
from slope_jax.model.config import ModelConfig
from slope_jax.parallel import stages
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine

TILES = dict(q_tile=32, kv_tile=24, moe_tile=16)
F32_TOL = 1e-5  # measured max |Δ| logits and K/V ~3e-6


@pytest.fixture(scope="module")
def reference(checkpoints):
    ref = PrefillEngine.from_checkpoint(checkpoints["B"]["mxfp4"], dtype="float32", progress=False, **TILES)
    prompts = [random_prompt(CONFIG_B, n, seed=n) for n in (23, 5, 61)]
    return ref, prompts, ref.prefill(prompts)


# Default suite: pipeline with ring and Ulysses together (2,2,2), with ring only (4,2,1), and 8 one-device stages of
# 1-2 layers (8,1,1); Ulysses-only stages (2,1,4), (4,1,2) run the same code paths and are `-m slow`.
PP_LAYOUTS = [(2, 2, 2), (4, 2, 1), (8, 1, 1), pytest.param((2, 1, 4), marks=pytest.mark.slow),
              pytest.param((4, 1, 2), marks=pytest.mark.slow)]


@pytest.mark.parametrize("layout", PP_LAYOUTS)
def test_pp_cp_equals_single_device(layout, checkpoints, reference):
    ref, prompts, expected = reference
    p, r, u = layout
    eng = PrefillEngine.from_checkpoint(checkpoints["B"]["mxfp4"], ParallelConfig(pipeline=p, ring=r, ulysses=u),
                                        dtype="float32", progress=False, **TILES)
    assert any(len(eng.plan.stage_layers(s)) % 2 == 1 for s in range(p))  # an odd layer count on some stage
    # a batch of 3 prompts of different lengths (in flight together when they share a bucket), and one alone
    for batch in (prompts, prompts[:1]):
        for a, b in zip(expected, eng.prefill(batch)):
            assert np.abs(a.logits - b.logits).max() < F32_TOL
            assert a.first_token == b.first_token
            # K/V carry global layer ids: layers 0…L−1, each exactly once over all stages
            assert sorted(b.kv) == list(range(CONFIG_B.num_hidden_layers))
            for layer in a.kv:
                assert b.kv[layer].kind == CONFIG_B.layer_types[layer]
                assert np.abs(a.kv[layer].k - b.kv[layer].k).max() < F32_TOL
                assert np.abs(a.kv[layer].v - b.kv[layer].v).max() < F32_TOL


def test_requests_in_flight_share_one_schedule(checkpoints, reference):
    """Three prompts of one bucket run in one compiled step with M = 3 (M + P − 1 = 5 ticks on 3 stages)."""
    ref, _, _ = reference
    prompts = [random_prompt(CONFIG_B, n, seed=200 + n) for n in (40, 33, 47)]
    eng = PrefillEngine.from_checkpoint(checkpoints["B"]["mxfp4"],
                                        ParallelConfig(pipeline=2, ring=2, ulysses=2, microbatches=3),
                                        dtype="float32", progress=False, **TILES)
    assert len({eng.bucket(len(x)) for x in prompts}) == 1
    results = eng.prefill(prompts)
    assert list(eng._compiled) == [(eng.bucket(40), 3)]
    for a, b in zip(ref.prefill(prompts), results):
        assert np.abs(a.logits - b.logits).max() < F32_TOL


def test_stage_split_is_stated_and_kinds_follow_global_index():
    cfg120 = ModelConfig.from_json("configs/gpt-oss-120b.json")
    plan = stages.plan_stages(cfg120, 5)  # 36 layers on 5 stages: 8 + 7 + 7 + 7 + 7
    assert [len(plan.stage_layers(p)) for p in range(5)] == [8, 7, 7, 7, 7]
    assert sorted(x for x in plan.flat if x >= 0) == list(range(36))
    for p in range(5):
        for s, layer in enumerate(plan.slot_layers[p]):
            if layer >= 0:  # slot 2j is sliding, 2j+1 full, by the layer's global index
                assert cfg120.is_sliding(int(layer)) == (s % 2 == 0)
    assert stages.plan_stages(cfg120, 4).empty_slots == 4  # 9 layers a stage: 10 slots, stacks of 9
    assert stages.plan_stages(cfg120, 4).stack_per_stage == 9
    assert stages.plan_stages(cfg120, 2).empty_slots == 0
    cfg20 = ModelConfig.from_json("configs/gpt-oss-20b.json")
    assert all(stages.plan_stages(cfg20, p).empty_slots == 0 for p in (1, 2, 3, 4, 6, 12))
    # 9 layers on 4 stages: 3 + 2 + 2 + 2; a stage starting on a full layer leaves its first (sliding) slot empty
    assert stages.plan_stages(CONFIG_B, 4).slot_layers.tolist() == [[0, 1, 2, -1], [-1, 3, 4, -1],
                                                                       [-1, 5, 6, -1], [-1, 7, 8, -1]]


def test_each_device_holds_only_its_stage(checkpoints):
    par = ParallelConfig(pipeline=4, ring=2)
    eng = PrefillEngine.from_checkpoint(checkpoints["B"]["mxfp4"], par,
                                        dtype="float32", progress=False, **TILES)
    w = eng.params["layers"]["wq"]
    full = ckpt_lib.load_checkpoint(checkpoints["B"]["mxfp4"], "float32", progress=False)[1]["layers"]["wq"]
    n = eng.plan.stack_per_stage
    assert n == 3  # 9 layers on 4 stages: 3 + 2 + 2 + 2, stacks of 3 (one padding entry on stages 1-3)
    coords = {d: p for p, stage in enumerate(eng.mesh.devices) for d in stage.reshape(-1)}
    for shard in w.addressable_shards:
        p = coords[shard.device]
        assert shard.data.shape[0] == n
        for j, layer in enumerate(eng.plan.stack_layers[p]):
            want = np.asarray(full[layer]) if layer >= 0 else 0
            np.testing.assert_array_equal(np.asarray(shard.data[j]), want)
    emb = eng.params["embed"]
    # vocabulary rows: split as the sharding table says (stages.vocab_shards devices)
    assert all(sh.data.shape[0] == stages.vocab_rows(CONFIG_B, par) // stages.vocab_shards(par)
               for sh in emb.addressable_shards)


def test_loader_reads_each_stage_tensor_once(checkpoints, monkeypatch):
    """Devices read only their stage's layers, and replicas within a stage share one read."""
    reads = []
    orig = ckpt_lib.TensorSource.handle

    def spy(self, name):
        reads.append(name)
        return orig(self, name)

    monkeypatch.setattr(ckpt_lib.TensorSource, "handle", spy)
    PrefillEngine.from_checkpoint(checkpoints["B"]["mxfp4"], ParallelConfig(pipeline=2, ring=2, ulysses=2),
                                  dtype="float32", progress=False)
    layer_reads = [n for n in reads if n.startswith("model.layers.")]
    # 19 tensors per layer, every layer read exactly once in total (q/k/v etc. are separate tensors in HF layout)
    assert len(layer_reads) == len(set(layer_reads)) == 19 * CONFIG_B.num_hidden_layers
    # one row block per device: the vocabulary is split over all 8 (the sharding table, stages.vocab_shards)
    assert reads.count("model.embed_tokens.weight") == 8


# P = 1 (the whole 9-layer model in one stage, the largest program to compile) is `-m slow`
@pytest.mark.parametrize("p", [pytest.param(1, marks=pytest.mark.slow), 2, 4, 8])
def test_schedule_steps(p, checkpoints):
    """GPipe takes M + P − 1 ticks for M requests on P stages: the trip count of the compiled tick loop."""
    from slope_jax.plan import traffic

    cfg = CONFIGS["B"]
    params = checkpoints["B"]["params"]  # numpy, the engine's layout: no initialisation programs to compile
    m = 3
    eng = PrefillEngine(cfg, params, ParallelConfig(pipeline=p, ulysses=8 // p), "float32", **TILES)
    assert traffic.schedule_ticks(eng.compiled(128, m).as_text()) == m + p - 1
