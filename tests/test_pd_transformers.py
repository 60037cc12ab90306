"""Prefill here, decode there: Hugging Face transformers' GptOssForCausalLM (eager, float32) continues from slope_jax
KV exports through `slope_jax.kv.to_transformers_cache`.

Models: the shipped tiny checkpoint (W=32, 6 layers, 2 KV heads) and CONFIG_B (W=7, 9 layers, 2 KV heads, head_dim 20).
Exports: the tiny checkpoint on 2 processes x 4 devices (ring 2 x Ulysses 4, one run writing both policies, run in
the background while the rest is built); CONFIG_B from layouts (1,1,1) and (2,2,2) (ring + Ulysses + pipeline), and
(1,2,4) in the slow suite (`-m slow`); the default (`last_window`) and the `kv_full` policy; prompt lengths 1, W−1, W,
W+1, 3W+5 and a long one (`_lengths`) in one prefill call per layout and policy. The reference is transformers' own
full prefill of prompt + first token.
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from support import CONFIG_B, REPO, SHIPPED, TILES, free_port, random_prompt

from slope_jax import kv, xla_env
from slope_jax.model.config import ModelConfig
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine

LOGIT_TOL = 1e-5  # measured max |Δlogit| 3.6e-6 (float32, tiny checkpoint, every layout and policy)
TINY = ModelConfig.from_json(os.path.join(SHIPPED, "config.json"))
CFGS = {"tiny": TINY, "B": CONFIG_B}
POLICIES = {"last_window": False, "full": True}
# CONFIG_B's layouts besides the single-device reference engine; (1,2,4) (ring x Ulysses, no pipeline) is a subset of
# what (2,2,2) exercises, so it runs only in the slow suite
B_LAYOUTS = {"2x2x2": ParallelConfig(pipeline=2, ring=2, ulysses=2)}
B_LAYOUTS_SLOW = {"1x2x4": ParallelConfig(ring=2, ulysses=4)}
GREEDY_TOKENS = 32


def _lengths(cfg):
    """1, W−1, W, W+1, 3W+5 and a long prompt: 1000 tokens (31 windows) on the tiny checkpoint; 10W+3 = 73 tokens
    (10 windows) on CONFIG_B, whose 8-token test tiles would make 1000 tokens cost minutes of compilation for the
    same class of case (many windows, many tiles, a sliding tail far from the start)."""
    w = cfg.sliding_window
    return [1, w - 1, w, w + 1, 3 * w + 5, 1000 if cfg is TINY else 10 * w + 3]


def _prompts(name):
    cfg = CFGS[name]
    prompts = [random_prompt(cfg, n, seed=700 + n) for n in _lengths(cfg)]
    return prompts, [f"len-{len(p)}" for p in prompts]


# Two processes x 4 CPU devices, as launch/local.sh runs them; one run exports both policies (one compile per bucket).
# Like the launcher, the worker keeps JAX's default matmul precision (CPU float32 dots run in float32 at either
# setting): its programs for buckets 16, 32 and 48 are then the ones tests/test_launcher.py's 2-process run compiled
# (same checkpoint, layout, dtype and tiles), served by the persistent compilation cache.
WORKER = r"""
import json, os, sys
import numpy as np
import jax
num, pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"127.0.0.1:{port}", num, pid, initialization_timeout=300)
from slope_jax.parallel.config import ParallelConfig
from slope_jax.serve.engine import PrefillEngine
with open(os.path.join(out, "spec.json")) as f:
    spec = json.load(f)
eng = PrefillEngine.from_checkpoint(spec["checkpoint"], ParallelConfig(ring=2, ulysses=4), dtype="float32",
                                    progress=False, q_tile=32, kv_tile=32, moe_tile=32)
prompts = [np.asarray(p, np.int32) for p in spec["prompts"]]
for policy, full in (("last_window", False), ("full", True)):
    eng.prefill(prompts, os.path.join(out, policy), ids=spec["ids"], kv_full=full)
"""


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """Starts the 2-process export of the tiny checkpoint; yields a function that waits for it and returns its dir."""
    base = tmp_path_factory.mktemp("pd_2proc")
    prompts, ids = _prompts("tiny")
    (base / "spec.json").write_text(json.dumps({"checkpoint": SHIPPED, "ids": ids,
                                                "prompts": [p.tolist() for p in prompts]}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # the XLA flags the launcher sets for --cpu_devices=4 (its programs, served by the cache)
    env.update(XLA_FLAGS=xla_env.xla_flags("", cpu_devices=4), JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    port = free_port()
    procs = []
    for i in (1, 0):
        log = open(base / f"p{i}.log", "w")
        procs.append((i, subprocess.Popen([sys.executable, "-c", WORKER, "2", str(i), str(port), str(base)],
                                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)))

    def wait():
        for i, p in procs:
            p.wait(timeout=900)
            assert p.returncode == 0, (base / f"p{i}.log").read_text()[-3000:]
        return base

    yield wait
    for _, p in procs:
        if p.poll() is None:
            p.kill()


def _export_b(engines, base):
    """Prefill CONFIG_B's prompts with every engine and policy → {("B", layout, policy): directory}."""
    prompts, ids = _prompts("B")
    out = {}
    for label, eng in engines.items():
        for policy, full in POLICIES.items():
            out[("B", label, policy)] = base / label / policy
            eng.prefill(prompts, str(out[("B", label, policy)]), ids=ids, kv_full=full)
    return out


def _b_engines(checkpoints, layouts):
    return {label: PrefillEngine.from_checkpoint(checkpoints["B"]["mxfp4"], par, dtype="float32", progress=False,
                                                 **TILES) for label, par in layouts.items()}


@pytest.fixture(scope="module")
def exports(two_process_run, checkpoints, reference_engines, tmp_path_factory):
    """{(model, source, policy): directory of exports}; CONFIG_B's layouts are built while the 2-process run of the
    tiny checkpoint goes on in the background."""
    engines = {"1x1x1": reference_engines["B"], **_b_engines(checkpoints, B_LAYOUTS)}
    out = _export_b(engines, tmp_path_factory.mktemp("pd_B"))
    tiny = two_process_run()
    for policy in POLICIES:
        out[("tiny", "2proc-2x4", policy)] = tiny / policy
    return out


@pytest.fixture(scope="module")
def exports_slow(checkpoints, tmp_path_factory):
    """CONFIG_B's exports from the slow-suite layouts: {("B", layout, policy): directory}."""
    return _export_b(_b_engines(checkpoints, B_LAYOUTS_SLOW), tmp_path_factory.mktemp("pd_B_slow"))


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    import transformers

    paths = {"tiny": SHIPPED, "B": checkpoints["B"]["dense"]}
    return {name: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
            for name, p in paths.items()}


def _forward(model, ids, cache=None):
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(ids), dtype=torch.long)[None], cache=cache, use_cache=cache is not None)
    return out.logits[0, -1].numpy()


def _check_sources(name, sources, model):
    """For every source and length: the cache reports the true length and the first decoded token's logits equal
    transformers' full prefill of prompt + first token (every source computed the same first token)."""
    cfg = CFGS[name]
    prompts, ids = _prompts(name)
    worst = 0.0
    for prompt, rid in zip(prompts, ids):
        firsts = {kv.read_manifest(str(d / rid))["first_token"] for d in sources.values()}
        assert len(firsts) == 1, (rid, firsts)  # every layout computed the same first token
        first = firsts.pop()
        ref = _forward(model, np.concatenate([prompt, [first]]))
        for key, d in sources.items():
            cache = kv.to_transformers_cache(d / rid, model)
            n = len(prompt)
            assert [cache.get_seq_length(i) for i in range(cfg.num_hidden_layers)] == [n] * cfg.num_hidden_layers
            for i, layer in enumerate(cache.layers):  # what transformers itself keeps: W−1 tokens on sliding layers
                assert layer.keys.shape == (1, cfg.num_key_value_heads,
                                            min(n, cfg.sliding_window - 1) if cfg.is_sliding(i) else n, cfg.head_dim)
            got = _forward(model, [first], cache)
            err = float(np.abs(got - ref).max())
            worst = max(worst, err)
            assert err <= LOGIT_TOL, (key, rid, err)
            assert int(np.argmax(got)) == int(np.argmax(ref)), (key, rid)
    print(f"{name}: max |Δlogit| {worst:.2e} over {len(sources)} sources x {len(prompts)} lengths")


@pytest.mark.parametrize("name", sorted(CFGS))
def test_decode_from_export_equals_full_prefill(name, exports, hf_models):
    """For every source, policy and length: the cache reports the true length and the first decoded token's logits
    equal transformers' full prefill of prompt + first token."""
    sources = {key: d for key, d in exports.items() if key[0] == name}
    assert len(sources) == (2 * (1 + len(B_LAYOUTS)) if name == "B" else 2)
    _check_sources(name, sources, hf_models[name])


def test_decode_from_a_prefix_hit_export_equals_full_prefill(checkpoints, hf_models, tmp_path):
    """transformers decodes the export of a prefix hit (cached rows beside the computed ones) like a cold one: the
    first decoded token's logits equal its own full prefill of prompt + first token (CONFIG_B, W = 7, blocks of 8:
    32 tokens reused, 15 computed)."""
    from slope_jax.kv.prefix import ReuseOptions

    eng = PrefillEngine.from_checkpoint(checkpoints["B"]["mxfp4"], dtype="float32", progress=False,
                                        reuse=ReuseOptions(block_size=8), **TILES)
    doc = random_prompt(CONFIG_B, 40, seed=31)
    prompt = np.concatenate([doc[:32], random_prompt(CONFIG_B, 15, seed=32)])
    eng.prefill([doc], str(tmp_path), ids=["doc"])
    res = eng.prefill([prompt], str(tmp_path), ids=["turn"])[0]
    assert res.cached_tokens == 32
    model = hf_models["B"]
    ref = _forward(model, np.concatenate([prompt, [res.first_token]]))
    got = _forward(model, [res.first_token], kv.to_transformers_cache(tmp_path / "turn", model))
    assert float(np.abs(got - ref).max()) <= LOGIT_TOL and int(np.argmax(got)) == int(np.argmax(ref))


@pytest.mark.slow
def test_decode_from_slow_layouts_equals_full_prefill(exports, exports_slow, hf_models):
    """CONFIG_B from the slow-suite layouts, checked together with the default ones (same first token everywhere)."""
    sources = {**{key: d for key, d in exports.items() if key[0] == "B"}, **exports_slow}
    assert len(sources) == 2 * (1 + len(B_LAYOUTS) + len(B_LAYOUTS_SLOW))
    _check_sources("B", sources, hf_models["B"])


@pytest.mark.parametrize("name,source,policy,length_index", [
    ("tiny", "2proc-2x4", "last_window", 4),  # 3W+5: 32 tokens cross the window again
    ("B", "2x2x2", "full", 3),                # W+1 with W=7: the sliding tail shifts four windows while decoding
])
def test_greedy_continuation_equals_transformers_generate(name, source, policy, length_index, exports, hf_models):
    model = hf_models[name]
    prompts, ids = _prompts(name)
    prompt, rid = prompts[length_index], ids[length_index]
    path = exports[(name, source, policy)] / rid
    tokens = [kv.read_manifest(str(path))["first_token"]]
    cache = kv.to_transformers_cache(path, model)
    while len(tokens) < GREEDY_TOKENS:
        tokens.append(int(np.argmax(_forward(model, [tokens[-1]], cache))))
    with torch.no_grad():
        ref = model.generate(torch.tensor(prompt, dtype=torch.long)[None], max_new_tokens=GREEDY_TOKENS,
                             do_sample=False)[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    if len(ref) < GREEDY_TOKENS:  # transformers stopped at an EOS token: compare up to it
        assert ref[-1] in (eos if isinstance(eos, list) else [eos])
    assert tokens[:len(ref)] == ref


def test_naive_cache_gets_the_wrong_position(exports, hf_models):
    """The bug this module exists for: loading a sliding layer's kept tail with update() alone makes transformers
    believe the sequence is as long as the rows kept (W plus up to VLLM_BLOCK_MAX − 1, `kv.kept_range`), and the next
    token is decoded at the wrong position. The 1000-token prompt: its sliding layers keep [841, 1000)."""
    import transformers

    model = hf_models["tiny"]
    prompts, ids = _prompts("tiny")
    prompt, rid = prompts[5], ids[5]
    path = exports[("tiny", "2proc-2x4", "last_window")] / rid
    first = kv.read_manifest(str(path))["first_token"]
    naive = transformers.DynamicCache(config=model.config)
    for layer, lk in kv.load(str(path)).items():
        naive.layers[layer].update(*(torch.from_numpy(np.array(a)).permute(1, 0, 2)[None] for a in (lk.k, lk.v)))
    lo, hi = kv.kept_range(len(prompt), "sliding_attention", TINY.sliding_window, False)
    assert lo > 0 and naive.get_seq_length() == hi - lo  # not len(prompt)
    ref = _forward(model, np.concatenate([prompt, [first]]))
    assert np.abs(_forward(model, [first], naive) - ref).max() > 0.1  # a wrong position: logits differ by O(1)
    good = kv.to_transformers_cache(path, model)
    assert good.get_seq_length() == len(prompt)
    assert np.abs(_forward(model, [first], good) - ref).max() <= LOGIT_TOL


def test_mismatched_model_is_refused(exports, hf_models):
    import transformers

    b_path = exports[("B", "2x2x2", "last_window")] / "len-26"
    tiny_path = exports[("tiny", "2proc-2x4", "last_window")] / "len-101"
    with pytest.raises(kv.KVModelMismatch, match=r"sliding_window is 7 in the export, 8 in the model"):
        kv.to_transformers_cache(b_path, dataclasses.replace(CONFIG_B, sliding_window=8))
    other_heads = transformers.GptOssConfig(**dataclasses.replace(TINY, num_key_value_heads=4).to_hf_dict())
    with pytest.raises(kv.KVModelMismatch, match=r"num_key_value_heads is 2 in the export, 4 in the model"):
        kv.to_transformers_cache(tiny_path, other_heads)
    with pytest.raises(kv.KVModelMismatch, match=r"head_dim is 24 in the export, 26 in the model"):
        kv.to_transformers_cache(tiny_path, dataclasses.replace(TINY, head_dim=26))
    with pytest.raises(kv.KVModelMismatch, match=r"num_hidden_layers is 9 in the export, 6 in the model"):
        kv.to_transformers_cache(b_path, hf_models["tiny"])
    swapped = tuple(reversed(CONFIG_B.layer_types[:-1])) + (CONFIG_B.layer_types[-1],)
    with pytest.raises(kv.KVModelMismatch, match=r"layer 0 kind is 'sliding_attention' in the export, "
                                                 r"'full_attention' in the model"):
        kv.to_transformers_cache(b_path, dataclasses.replace(CONFIG_B, layer_types=swapped))
    other_rope = dataclasses.replace(TINY, rope_theta=10000.0)
    with pytest.raises(kv.KVModelMismatch, match="model fingerprint"):
        kv.to_transformers_cache(tiny_path, other_rope)
    assert kv.to_transformers_cache(tiny_path, other_rope, check_fingerprint=False).get_seq_length() == 101
    # a cache the default export cannot serve: sliding layers keep only [n−W−127, n) (1000 tokens: [841, 1000))
    long_path = exports[("tiny", "2proc-2x4", "last_window")] / "len-1000"
    with pytest.raises(kv.KVFormatError, match=r"layer 0 \(sliding_attention\) holds \[841, 1000\); a cache of 500 "
                                               r"tokens needs \[469, 500\) \(export with kv_full"):
        kv.to_transformers_cache(long_path, hf_models["tiny"], num_tokens=500)


def test_decode_cli_first_token_check_and_engines(exports, tmp_path):
    """`python -m slope_jax.decode` on the 2-process export: each engine recomputes the first token from the prompt's
    last token (cache of n−1 tokens, empty for n = 1) and agrees with the prefill; transformers and the JAX reference
    decoder produce the same tokens; a request whose prompt differs from the export's is an error, not a wrong
    answer."""
    from absl import flags

    from slope_jax.serve import decode_cli

    prompts, ids = _prompts("tiny")
    kv_dir = exports[("tiny", "2proc-2x4", "last_window")]
    reqs = [{"id": rid, "tokens": p.tolist()} for rid, p in zip(ids, prompts)]
    reqs[2]["tokens"][5] = (reqs[2]["tokens"][5] + 1) % TINY.vocab_size  # len-32: not the prompt that was exported
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    outs = {}
    for engine, chosen in (("transformers", ids), ("reference", ["len-33"])):
        out = tmp_path / f"{engine}.jsonl"
        argv = ["slope-decode", f"--kv_dir={kv_dir}", f"--ids={','.join(chosen)}", f"--engine={engine}",
                f"--requests={tmp_path / 'requests.jsonl'}", "--max_new_tokens=6", f"--output={out}",
                f"--checkpoint={SHIPPED}", "--nostop_at_eos"]
        fv = decode_cli.define_flags(flags.FlagValues())
        fv(argv)
        rc = decode_cli.main(["slope-decode"], fv)
        outs[engine] = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        assert rc == (1 if engine == "transformers" else 0)  # len-32's prompt was changed
    tr = outs["transformers"]
    assert "is not the one exported" in tr["len-32"]["error"]
    for rid in ids[:2] + ids[3:]:  # len-1 replays from an empty cache
        r = tr[rid]
        assert r["first_token_check"] == "ok" and r["decoded_first_token"] == r["first_token"], r
        assert len(r["tokens"]) == 6 and r["tokens"][0] == r["first_token"] and isinstance(r["text"], str)
    ref = outs["reference"]["len-33"]
    assert ref["first_token_check"] == "ok" and ref["tokens"] == tr["len-33"]["tokens"]


def test_decode_check_calls_flat_or_non_finite_logits_a_mismatch(exports):
    """KV corrupted past its checksum (values ~1e28) made every logit 0.0: argmax 0 against the manifest's token, gap
    0, reported as a near tie. Logits that prefer no token (not finite, or all equal) are a mismatch with a note."""
    import types

    from slope_jax.serve import decode_cli

    prompts, ids = _prompts("tiny")
    path = os.path.join(exports[("tiny", "2proc-2x4", "last_window")], ids[3])
    for bad in (np.zeros(TINY.vocab_size, np.float32), np.full(TINY.vocab_size, np.nan, np.float32)):
        engine = types.SimpleNamespace(cfg=TINY, check_fingerprint=True, name="fake",
                                       start=lambda path, n, bad=bad: (lambda token: bad))
        rec = decode_cli.decode_request(engine, path, max_new_tokens=1, prompt=prompts[3])
        assert rec["first_token_check"] == "mismatch" and "corrupt" in rec["first_token_note"], rec


def test_decode_summary_says_the_shipped_model_is_random(tmp_path):
    """The shipped tiny checkpoint has random weights: the summary says its text is gibberish by design (also when
    reached through a symlink); any other checkpoint gets no such note."""
    from types import SimpleNamespace

    from slope_jax.serve import decode_cli

    link = tmp_path / "tiny"
    link.symlink_to(SHIPPED)
    for path, noted in ((SHIPPED, True), (str(link), True), (str(tmp_path), False)):
        text = decode_cli._summary([], 0.0, SimpleNamespace(checkpoint=path, engine="transformers", dtype="float32"))
        assert ("random weights" in text and "gibberish by design" in text) == noted, (path, text)


_NO_JAX_LOAD = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib"):
            raise ImportError("blocked: a decode engine has no JAX")
sys.meta_path.insert(0, Block())
import slope_jax.kv as kv
layers = kv.load(sys.argv[1])
print(layers[0].k.dtype, layers[1].k.shape[0], layers[0].k.shape[0])
"""


def test_bfloat16_export_without_jax(tmp_path):
    """The launcher exports bfloat16 by default and a decode engine has no JAX: the reader must know numpy's
    'bfloat16' (ml_dtypes) on its own, and the transformers cache must receive the values exactly."""
    import ml_dtypes

    n, w = 40, TINY.sliding_window
    rng = np.random.default_rng(3)
    shape = (n, TINY.num_key_value_heads, TINY.head_dim)
    full = {layer: [rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for _ in "kv"]
            for layer in range(TINY.num_hidden_layers)}
    export = tmp_path / "bf16"  # the manifest's request id names its directory
    export.mkdir()
    records, files = [], []
    for proc, (lo, hi) in enumerate(((0, 20), (20, n))):  # two processes' pieces, as a ring of 2 writes them
        segs = []
        for layer, (k, v) in full.items():
            a, b = kv.kept_range(n, TINY.layer_types[layer], w, False)
            a, b = max(a, lo), min(b, hi)
            if a < b:
                segs.append((layer, a, b, k[a:b], v[a:b]))
        name, recs = kv.write_shard_file(str(export), proc, segs)
        records += recs
        files.append(name)
    ids = random_prompt(TINY, n, seed=1)
    kv.write_manifest(str(export), request_id="bf16", token_ids=ids, cfg=TINY, dtype="bfloat16", full=False,
                      segments=records, files=files, first_token=5)
    out = subprocess.run([sys.executable, "-c", _NO_JAX_LOAD, str(export)], capture_output=True, text=True,
                         timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    lo, hi = kv.kept_range(n, "sliding_attention", w, False)  # the sliding rows a last_window export keeps
    assert out.returncode == 0 and out.stdout.split() == ["bfloat16", str(n), str(hi - lo)], out.stderr[-2000:]
    exact = kv.to_transformers_cache(export, TINY)  # the export's dtype: bit-exact bfloat16
    wide = kv.to_transformers_cache(export, TINY, dtype=torch.float32)
    for layer, (k, v) in full.items():
        rows = slice(n - (w - 1), n) if TINY.is_sliding(layer) else slice(0, n)
        for got, want in ((exact.layers[layer].keys, k), (wide.layers[layer].values, v)):
            ref = torch.from_numpy(want[rows].astype(np.float32)).permute(1, 0, 2)[None]
            assert got.dtype == (torch.bfloat16 if got is exact.layers[layer].keys else torch.float32)
            assert torch.equal(got.float(), ref)
