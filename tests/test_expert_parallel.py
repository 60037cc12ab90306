"""Expert parallelism (EP): experts split over a stage's ring × Ulysses devices.

Checked against the single-device path (float32): logits and K/V of whole prefills on every EP layout (all-to-all
dispatch, the default, and the all-gather dispatch), the per-device expert bytes (arrays and the compiled program's
memory analysis), the MoE collective bytes in the compiled HLO against `plan.moe_traffic` (and the all-to-all's
against the all-gather's), which expert rows the loader reads, skewed routing that takes several all-to-all rounds,
pad tokens, the expert output bias, and the layout errors; with sequence chunks too (`test_ep_with_seq_chunks`: the
experts stay split inside the chunked step). CONFIG_E has 8 experts, so EP = R·U for R·U ∈ {2, 4, 8}.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import assert_prefill_close, random_prompt
from jax.sharding import PartitionSpec as Ps

from slope_jax.checkpoints import hf as ckpt_lib
from slope_jax.checkpoints import writer as checkpoint_writer
from slope_jax.model import gpt_oss as model_lib
from slope_jax.model import moe as moe_lib
from slope_jax.model.config import FULL, SLIDING, ModelConfig
from slope_jax.model.options import StepOptions
from slope_jax.parallel import expert_parallel
from slope_jax.parallel.config import LayoutError, ParallelConfig
from slope_jax.plan import moe_traffic, traffic
from slope_jax.serve.engine import PrefillEngine

# pairwise-distinct sizes: hidden 96, heads 16, kv heads 2, head_dim 20, experts 8, top-k 3, intermediate 64,
# vocab 352, window 7
CONFIG_E = ModelConfig(
    num_hidden_layers=4, num_experts=8, experts_per_token=3, vocab_size=352, hidden_size=96, intermediate_size=64,
    num_attention_heads=16, num_key_value_heads=2, head_dim=20, sliding_window=7,
    layer_types=(SLIDING, FULL) * 2, eos_token_ids=(4,), pad_token_id=0)
TILES = dict(q_tile=16, kv_tile=16, moe_tile=16)
F32_TOL = 1e-5  # measured max |Δ| logits ~5e-7, K/V ~1e-6
EXPERT_PARAMS = ("w1_blocks", "w1_scales", "w2_blocks", "w2_scales", "b1", "b2")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt_E") / "mxfp4")
    checkpoint_writer.write_hf(ckpt, CONFIG_E, checkpoint_writer.random_params(CONFIG_E, seed=11), num_shards=2)
    ref = PrefillEngine.from_checkpoint(ckpt, dtype="float32", progress=False, **TILES)
    prompts = [random_prompt(CONFIG_E, n, seed=n) for n in (45, 39)]  # cross the window; not multiples of 2·R·U
    return ckpt, prompts, ref.prefill(prompts)


class _ReadLog:
    """Records the rows of every safetensors read: (name, start, stop); a whole-tensor read is (name, 0, None)."""

    def __init__(self):
        self.reads = []

    def wrap(self, handle):
        log = self.reads

        class Slice:
            def __init__(self, name):
                self.name, self.inner = name, handle.get_slice(name)

            def __getitem__(self, key):
                log.append((self.name, key.start, key.stop))
                return self.inner[key]

            def get_shape(self):  # the loader's read digests ask the slice for its shape
                return self.inner.get_shape()

        class Handle:
            def get_tensor(self, name):
                log.append((name, 0, None))
                return handle.get_tensor(name)

            def get_slice(self, name):
                return Slice(name)

        return Handle()


def _device_bytes(tree, device) -> int:
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


def _moe_hlo_collectives(hlo: str) -> list:
    """The collectives of the EP dispatch/combine only (ops whose op_name has the `expert_parallel` scope), as
    `plan.traffic.hlo_collectives` counts them (all-to-all operand, all-gather input, reduce-scatter output; × trips;
    one pass of the all-to-all's round loop)."""
    def other(line):
        return any(f" {c}(" in line or f" {c}-start(" in line for c in traffic.COLLECTIVES) and \
            "/expert_parallel/" not in line
    return traffic.hlo_collectives("\n".join(x for x in hlo.splitlines() if not other(x)))


def _moe_hlo_bytes(cols: list) -> dict:
    out: dict = {}
    for c in cols:
        out[c.kind] = out.get(c.kind, 0) + c.total
    return out


def _assert_expert_bytes_split(eng, par, length: int):
    """Per-device expert bytes = total / (P·R·U): exactly in the placed arrays, ±2 % in the compiled program's
    arguments (what is left after tokens, positions and the other parameters). Returns the compiled step."""
    p, r, u = par.pipeline, par.ring, par.ulysses
    layers = eng.params["layers"]
    experts = {k: layers[k] for k in EXPERT_PARAMS}
    expert_total = sum(x.nbytes for x in experts.values())
    devices = list(eng.mesh.devices.reshape(-1))
    for d in devices:
        assert _device_bytes(experts, d) * p * r * u == expert_total
    t, m = eng.bucket(length), par.in_flight
    compiled = eng.compiled(t, m)
    args = compiled.memory_analysis().argument_size_in_bytes
    inputs = (m * t + t) * 4 // (r * u) + 4 * m  # tokens, positions (sharded over ring·ulysses), num_tokens
    other = _device_bytes(eng.params, devices[0]) - _device_bytes(experts, devices[0])
    assert abs((args - inputs - other) - expert_total / (p * r * u)) <= 0.02 * expert_total / (p * r * u)
    return compiled


# the all-gather dispatch on one layout, the default all-to-all on the others (one compile each); (1,4,2) is the
# same all-to-all path as (1,2,4) with the degrees swapped: `-m slow`
@pytest.mark.parametrize("layout,dispatch", [((1, 2, 4), "auto"),
                                             pytest.param((1, 4, 2), "auto", marks=pytest.mark.slow),
                                             ((2, 2, 2), "auto"), ((1, 8, 1), "all_gather")])
def test_ep_equals_single_device(layout, dispatch, setup, monkeypatch):
    ckpt, prompts, expected = setup
    p, r, u = layout
    par = ParallelConfig(pipeline=p, ring=r, ulysses=u)
    ep = par.expert_degree(CONFIG_E)
    assert ep == r * u  # the default: EP on

    log = _ReadLog()
    orig = ckpt_lib.TensorSource.handle
    monkeypatch.setattr(ckpt_lib.TensorSource, "handle", lambda self, name: log.wrap(orig(self, name)))
    eng = PrefillEngine.from_checkpoint(ckpt, par, dtype="float32", progress=False, ep_dispatch=dispatch, **TILES)
    monkeypatch.undo()
    assert eng.options.ep_dispatch == ("all_to_all" if dispatch == "auto" else dispatch)  # auto: all_to_all on CPU

    # the loader read each expert tensor's rows exactly once over all devices, never the whole tensor
    experts = {}
    for name, a, b in log.reads:
        if ".mlp.experts." in name:
            assert b is not None, f"{name} read whole"
            experts.setdefault(name, []).append((a, b))
    assert len(experts) == CONFIG_E.num_hidden_layers * len(EXPERT_PARAMS)
    for name, rows in experts.items():
        assert sorted(rows) == [(e * (8 // ep), (e + 1) * (8 // ep)) for e in range(ep)], (name, rows)

    # parity with the single-device path (a batch of two prompts in flight, different lengths)
    assert_prefill_close(expected, eng.prefill(prompts), F32_TOL)

    # per-device expert bytes = total / (P·R·U), exactly in the arrays, ±2 % in the compiled program
    compiled = _assert_expert_bytes_split(eng, par, len(prompts[0]))

    # MoE collective bytes in the HLO = plan.moe_traffic (float32 activations)
    t, m, k = eng.bucket(len(prompts[0])), par.in_flight, CONFIG_E.experts_per_token
    pred = moe_traffic.moe_traffic(CONFIG_E, par, t, m, eng.plan.slots_per_stage, 4, eng.options)
    cols = _moe_hlo_collectives(compiled.as_text())
    meas = _moe_hlo_bytes(cols)
    gather = moe_traffic.moe_traffic(CONFIG_E, par, t, m, eng.plan.slots_per_stage, 4,
                                     StepOptions(ep_dispatch="all_gather"))
    if eng.options.ep_dispatch == "all_gather":
        assert set(meas) == {"all-gather", "reduce-scatter"}, meas
        assert meas["all-gather"] == pred.all_gather_block, (meas, pred)  # measured: exact
        assert meas["reduce-scatter"] == pred.reduce_scatter_block, (meas, pred)
        return
    # all-to-all: the EP collectives are all-to-alls inside the round loop (bytes per round exact) and the round
    # count's all-reduce (4 bytes per block, outside the loop)
    assert set(meas) == {"all-to-all", "all-reduce"}, meas
    assert all(bool(x.loop) == (x.kind == "all-to-all") for x in cols), cols
    assert meas["all-to-all"] == pred.all_to_all_block, (meas, pred)  # measured: exact
    assert meas["all-reduce"] == pred.all_reduce_block == 4 * pred.moe_blocks, (meas, pred)
    t_loc = t // (r * u)
    c = pred.rows
    assert c == min(t_loc, -(-5 * t_loc * k // (4 * ep)))  # ⌈1.25·T_loc·k/EP⌉ rows per pair and round
    # wire bytes of one round against today's all-gather dispatch: exactly c/T_loc (≈ 1.25·k/EP)
    rounds_wire = pred.wire - pred.moe_blocks * (ep - 1) * 4
    assert rounds_wire * t_loc == gather.wire * c, (pred, gather)
    assert rounds_wire <= gather.wire * (1.25 * k / ep + 1 / t_loc)
    print(f"{layout}: T_loc {t_loc}, c {c}, one round {pred.wire} B vs all-gather {gather.wire} B "
          f"({pred.wire / gather.wire:.3f}; 1.25·k/EP = {1.25 * k / ep:.3f})")


def _ep_moe(h, valid, p, ring, ulysses, k, **dispatch):
    """Run `moe_expert_parallel` under a (ring, ulysses) shard_map on the first R·U devices: tokens split over the
    devices, expert parameters split by experts, router replicated. `dispatch`: its dispatch / capacity keywords."""
    return np.asarray(_ep_moe_fn(ring, ulysses, k, tuple(sorted(p)), tuple(sorted(dispatch.items())))(h, valid, p))


@functools.lru_cache(maxsize=None)
def _ep_moe_fn(ring, ulysses, k, names, dispatch):
    """The jitted `_ep_moe` program, one per configuration (calls with new parameter values reuse its compilation)."""
    mesh = jax.make_mesh((ring, ulysses), ("ring", "ulysses"), devices=jax.devices()[:ring * ulysses],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cp = ("ring", "ulysses")
    pspec = {name: Ps() if name.startswith("router") else Ps(cp) for name in names}
    fn = functools.partial(expert_parallel.moe_expert_parallel, ulysses=ulysses, experts_per_token=k, alpha=1.702,
                           limit=7.0, tile=4, **dict(dispatch))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(Ps(cp), Ps(cp), pspec), out_specs=Ps(cp), check_vma=False))


def _dense_moe_params(rng, e, d, i, scale=0.3):
    return {"router_w": jnp.asarray(rng.standard_normal((e, d)), jnp.float32),
            "router_b": jnp.asarray(rng.standard_normal(e), jnp.float32),
            "w1": jnp.asarray(scale * rng.standard_normal((e, 2 * i, d)), jnp.float32),
            "w2": jnp.asarray(scale * rng.standard_normal((e, d, i)), jnp.float32),
            "b1": jnp.asarray(0.1 * rng.standard_normal((e, 2 * i)), jnp.float32),
            "b2": jnp.asarray(0.1 * rng.standard_normal((e, d)), jnp.float32)}


def _rounds(ids, devices: int, experts_local: int, rows: int) -> int:
    """All-to-all rounds for routing `ids [T, k]` split over `devices` in order: ⌈largest (source, destination)
    token count / rows⌉ (a token counts once per destination, however many of its experts live there)."""
    t_loc = ids.shape[0] // devices
    owner = ids.reshape(devices, t_loc, -1) // experts_local
    pair = [[np.any(owner[s] == j, axis=1).sum() for j in range(devices)] for s in range(devices)]
    return -(-int(np.max(pair)) // rows)


def test_skewed_routing_and_pads():
    """Every token picks expert 5 first (router bias 50): one device does all top-1 work and is sent every token —
    T_loc rows per source, over twice its all-to-all share (1.25·T_loc·k/EP) — so the all-to-all takes several
    rounds, and the result stays equal to the single-device MoE (dropless), on every dispatch. Pad tokens (last 5,
    one device's whole block) get exactly zero output."""
    rng = np.random.default_rng(3)
    e, d, i, k, t = 8, 24, 10, 3, 40
    p = _dense_moe_params(rng, e, d, i)
    h = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    valid = jnp.arange(t) < t - 5
    for skew in (False, True):
        if skew:
            p["router_b"] = p["router_b"].at[5].set(50.0)
        ref = np.asarray(moe_lib.moe(h, valid, p, experts_per_token=k, alpha=1.702, limit=7.0, tile=4))
        _, ids = moe_lib.route(h, p["router_w"], p["router_b"], k)
        ids = np.where(np.asarray(valid)[:, None], np.asarray(ids), e)
        assert (ids[:35, 0] == 5).all() == skew
        ep, t_loc = 8, t // 8  # ring 2 × Ulysses 4
        rows = StepOptions().ep_rows(t_loc, k, ep)  # default capacity 1.25: ⌈1.25·5·3/8⌉ = 3
        rounds = _rounds(ids, ep, e // ep, rows)
        if skew:  # the skewed peer gets T_loc rows from each source: ⌈T_loc / c⌉ = ⌈5/3⌉ = 2 rounds
            assert rounds == -(-t_loc // rows) == 2, rounds
        out = _ep_moe(h, valid, p, 2, 4, k, dispatch="all_to_all", capacity=1.25)
        # measured ≤ 4.8e-7 (the order of a token's k-term float32 sum differs)
        assert np.abs(out - ref).max() < 1e-6, (skew, rounds)
        assert (out[t - 5:] == 0).all()
        out = _ep_moe(h, valid, p, 2, 4, k, dispatch="all_gather")
        assert np.abs(out - ref).max() < 1e-6  # measured 0.0
        assert (out[t - 5:] == 0).all()
    # an assignment to an expert outside the device's slice (or a pad's id E) does no work, whatever its weight
    skipped = moe_lib.experts(h, jnp.ones((t, k)), jnp.full((t, k), e, jnp.int32), p, alpha=1.702, limit=7.0)
    assert (np.asarray(skipped) == 0).all()
    with pytest.raises(ValueError, match="ep_dispatch='auto'"):
        _ep_moe(h, valid, p, 2, 4, k, dispatch="auto")


def test_hlo_reader_counts_the_round_loop_once():
    """A collective inside a loop of unknown trip count (the all-to-all's rounds) counts one pass of that loop times
    the known trip counts around it, and names the loop; one outside it counts as usual."""
    hlo = """HloModule m
%rounds (p: f32[4]) -> f32[4] {
  %a = (f32[1,2,3]{2,1,0}, f32[1,2,3]{2,1,0}) all-to-all(%x, %y), channel_id=1, replica_groups={{0,1}}
}
%layers (p: f32[4]) -> f32[4] {
  %w = f32[4] while(%p), condition=%c, body=%rounds, metadata={op_name="s/expert_parallel/while"}
  %m = s32[] all-reduce(%n), channel_id=2, replica_groups={{0,1}}, to_apply=%max
}
ENTRY %main (x: f32[4]) -> f32[4] {
  %l = f32[4] while(%x), condition=%c, body=%layers, backend_config={"known_trip_count":{"n":"3"}}
}
"""
    by_kind = {c.kind: c for c in traffic.hlo_collectives(hlo)}
    a2a, ar = by_kind["all-to-all"], by_kind["all-reduce"]
    assert (a2a.bytes, a2a.executions, a2a.loop) == (2 * 6 * 4, 3, "s/expert_parallel/while")
    assert (ar.total, ar.loop) == (3 * 4, "")


def test_expert_bias_added_once_weighted():
    """docs/model.md §5.1: zero expert weights, bias 1 → output exactly 1.0 per channel; bias[e] = e → Σ_k w_k·e_k."""
    rng = np.random.default_rng(4)
    e, d, i, k, t = 8, 24, 10, 3, 40  # the shapes of test_skewed_routing_and_pads: its compiled program
    p = _dense_moe_params(rng, e, d, i)
    p.update(w1=jnp.zeros_like(p["w1"]), w2=jnp.zeros_like(p["w2"]), b2=jnp.ones((e, d), jnp.float32))
    h = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    valid = jnp.ones(t, bool)
    out = _ep_moe(h, valid, p, 2, 4, k, dispatch="all_to_all", capacity=1.25)
    assert np.abs(out - 1.0).max() <= 1e-6  # Σ_k w_k = 1 in float32
    p["b2"] = jnp.broadcast_to(jnp.arange(e, dtype=jnp.float32)[:, None], (e, d))
    w, ids = (np.asarray(x) for x in moe_lib.route(h, p["router_w"], p["router_b"], k))
    want = (w * ids).sum(1)
    out = _ep_moe(h, valid, p, 2, 4, k, dispatch="all_to_all", capacity=1.25)
    assert np.abs(out - want[:, None]).max() <= 1e-5


def test_layout_errors_name_the_expert_count():
    assert ParallelConfig(ring=2, ulysses=2).expert_degree(CONFIG_E) == 4
    assert ParallelConfig(ring=3).expert_degree(CONFIG_E) == 1  # 3 does not divide 8: experts replicated
    assert ParallelConfig(ring=2, ulysses=4, expert=1).validate(CONFIG_E).expert_degree(CONFIG_E) == 1
    with pytest.raises(LayoutError, match=r"expert=3 must divide num_experts=8"):
        ParallelConfig(ring=3, expert=3).validate(CONFIG_E)
    with pytest.raises(LayoutError, match=r"expert=2: .* ring\*ulysses = 2\*2 = 4"):
        ParallelConfig(ring=2, ulysses=2, expert=2).validate(CONFIG_E)
    with pytest.raises(LayoutError, match="expert=0"):
        ParallelConfig(expert=0)


def test_moe_traffic_formula():
    """The stated formulas by hand for (P, R, U) = (2, 2, 2), T = 64, M = 2, S = 2, bf16: T_loc = 16, EP = 4."""
    par = ParallelConfig(pipeline=2, ring=2, ulysses=2)
    blocks = (2 + 2 - 1) * 2
    tr = moe_traffic.moe_traffic(CONFIG_E, par, 64, 2, 2, 2, StepOptions(ep_dispatch="all_gather"))
    ag, rs = 16 * (96 * 2 + 8 * 3), 16 * 96 * 4
    assert (tr.expert_degree, tr.moe_blocks, tr.dispatch) == (4, blocks, "all_gather")
    assert tr.all_gather_block == blocks * ag and tr.reduce_scatter_block == blocks * rs
    assert tr.wire == blocks * 3 * (ag + rs) and tr.operand == blocks * (ag + 4 * rs)
    # all-to-all (the default): c = ⌈1.25·16·3/4⌉ = 15 rows per pair; a row out D·b + 8k, back D·4
    a2a = moe_traffic.moe_traffic(CONFIG_E, par, 64, 2, 2, 2)
    assert (a2a.dispatch, a2a.rows) == ("all_to_all", 15)
    assert a2a.all_to_all_block == blocks * 4 * 15 * (96 * 2 + 8 * 3 + 96 * 4) and a2a.all_reduce_block == blocks * 4
    assert a2a.operand == a2a.block_total == a2a.all_to_all_block + a2a.all_reduce_block
    assert a2a.wire == blocks * 3 * (15 * (96 * 2 + 8 * 3 + 96 * 4) + 4)
    assert (a2a.wire - blocks * 3 * 4) * 16 == tr.wire * 15  # one round: c/T_loc of the all-gather's wire bytes
    assert moe_traffic.moe_traffic(CONFIG_E, par, 64, 2, 2, 2, StepOptions(ep_capacity=0.2)).rows == 3
    assert moe_traffic.moe_traffic(CONFIG_E, par, 64, 2, 2, 2, StepOptions(ep_capacity=9.0)).rows == 16  # T_loc
    assert moe_traffic.moe_traffic(CONFIG_E, ParallelConfig(ring=3), 66, 1, 4, 2).wire == 0


def test_ep_options_name_the_field():
    """`ep_dispatch` resolves to all_to_all on every backend; bad values name the field; the options (and so the
    launcher's fingerprint, `StepOptions.to_dict`) carry both EP fields."""
    assert {StepOptions().resolve(pl).ep_dispatch for pl in ("cpu", "cuda", "rocm", "tpu")} == {"all_to_all"}
    assert StepOptions(ep_dispatch="all_gather").resolve("cpu").ep_dispatch == "all_gather"
    assert {"ep_dispatch", "ep_capacity"} <= set(StepOptions().to_dict())
    with pytest.raises(ValueError, match="ep_dispatch='ragged'"):
        StepOptions(ep_dispatch="ragged")
    for bad in (0, -1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="ep_capacity"):
            StepOptions(ep_capacity=bad)
    with pytest.raises(ValueError, match="ep_dispatch"):
        StepOptions(ep_dispatch="auto").require_resolved()
    assert StepOptions(ep_capacity=1.0).ep_rows(12, 3, 4) == 9  # exact share, no float round-up to 10
    assert StepOptions(ep_capacity=0.001).ep_rows(12, 3, 4) == 1


def test_declared_expert_axes():
    """Expert weights carry the `experts` logical axis (split under EP); the router does not (replicated)."""
    specs = model_lib.param_specs(CONFIG_E, "float32")["layers"]
    assert all(specs[n].axes[1] == "experts" for n in EXPERT_PARAMS)
    assert "experts" not in specs["router_w"].axes and "experts" not in specs["router_b"].axes


HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "uint8": "u8"}


# (2,2,2)×C=4 (pipeline + EP + chunks) in the default suite; (1,2,4)×C=3 adds nothing new to the fault class: -m slow
@pytest.mark.parametrize("layout,chunks", [((2, 2, 2), 4), pytest.param((1, 2, 4), 3, marks=pytest.mark.slow)])
def test_ep_with_seq_chunks(layout, chunks, setup):
    """Expert parallelism inside the sequence-pipelined step (issue 19): parity with one device, and the experts stay
    split inside the chunked step — per-device expert bytes = total/(P·R·U) in the arrays and the compiled program's
    arguments, and no array of the gathered (all-experts) shape anywhere in its HLO (the step once declared the
    experts replicated, so jit all-gathered them onto every device: outputs right, memory 4–8× larger)."""
    ckpt, prompts, expected = setup
    p, r, u = layout
    par = ParallelConfig(pipeline=p, ring=r, ulysses=u, seq_chunks=chunks)
    ep = par.expert_degree(CONFIG_E)
    assert ep == r * u and CONFIG_E.num_experts % (r * u) == 0
    eng = PrefillEngine.from_checkpoint(ckpt, par, dtype="float32", progress=False,
                                        devices=jax.devices()[:p * r * u], **TILES)
    assert_prefill_close(expected, eng.prefill(prompts), F32_TOL)

    compiled = _assert_expert_bytes_split(eng, par, len(prompts[0]))
    layers = eng.params["layers"]

    collectives = [x for x in compiled.as_text().splitlines()
                   if any(f" {c}(" in x or f" {c}-start(" in x for c in traffic.COLLECTIVES)]
    for k in EXPERT_PARAMS:
        local = layers[k].addressable_shards[0].data.shape  # [n, E/EP, …] on one device
        assert local[1] * ep == CONFIG_E.num_experts, (k, local)
        whole = (local[0], CONFIG_E.num_experts, *local[2:])
        gathered = f"{HLO_DTYPES[layers[k].dtype.name]}[{','.join(map(str, whole))}]"
        assert not [x for x in collectives if gathered in x], f"{k}: the chunked step gathers all experts ({gathered})"
