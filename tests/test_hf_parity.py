"""Single-device prefill == Hugging Face transformers' GptOss (eager, float32) on the same weights.

Both tiny configs, prompt lengths 1, W−1, W, W+1 and 3W+7, loaded from the released MXFP4 layout (3 shards + index)
and from HF's unquantized layout; the original/ layout gives bit-identical output. K and V of every layer equal
transformers' cache (which keeps the last W−1 tokens on sliding layers).
"""

import numpy as np
import pytest
import torch
from support import CONFIGS, TILES, random_prompt

from slope_jax.serve.engine import PrefillEngine

# measured max |Δ| over both configs, both layouts, all lengths (float32): logits 2.5e-6, K/V 4.1e-6
LOGIT_TOL = 1e-5  # 4x the measured error
KV_TOL = 2e-5  # 5x the measured error


def _lengths(cfg):
    w = cfg.sliding_window
    return [1, w - 1, w, w + 1, 3 * w + 7]


@pytest.fixture(scope="module")
def hf_models(checkpoints):
    import transformers

    out = {}
    for name, c in checkpoints.items():
        m = transformers.AutoModelForCausalLM.from_pretrained(c["mxfp4"], dtype=torch.float32,
                                                              attn_implementation="eager")
        out[name] = m.eval()
    return out


def _hf_run(model, ids):
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long)[None], use_cache=True)
    kv = {}
    cache = out.cache if hasattr(out, "cache") else out.past_key_values  # transformers >= 5.2x renamed it
    for i, layer in enumerate(cache.layers):
        kv[i] = (layer.keys[0].permute(1, 0, 2).numpy(), layer.values[0].permute(1, 0, 2).numpy())
    return out.logits[0, -1].numpy(), kv


@pytest.fixture(scope="module")
def engines(checkpoints):
    return {(name, fmt): PrefillEngine.from_checkpoint(c[fmt], dtype="float32", progress=False, **TILES)
            for name, c in checkpoints.items() for fmt in ("mxfp4", "dense")}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("fmt", ["mxfp4", "dense"])
def test_logits_and_kv_match_transformers(name, fmt, hf_models, engines):
    cfg = CONFIGS[name]
    engine = engines[(name, fmt)]
    prompts = [random_prompt(cfg, n, seed=n) for n in _lengths(cfg)]
    results = engine.prefill(prompts)
    for ids, res in zip(prompts, results):
        ref_logits, ref_kv = _hf_run(hf_models[name], ids)
        assert res.num_tokens == len(ids)
        err = np.abs(res.logits - ref_logits).max()
        assert err < LOGIT_TOL, f"{name}/{fmt} T={len(ids)}: max |Δlogit| = {err}"
        assert res.first_token == int(np.argmax(ref_logits))
        assert sorted(res.kv) == list(range(cfg.num_hidden_layers))
        for layer, (k_ref, v_ref) in ref_kv.items():
            n = k_ref.shape[0]  # HF keeps only the last W−1 tokens of sliding layers
            if cfg.is_sliding(layer):
                assert n == min(len(ids), cfg.sliding_window - 1)
            else:
                assert n == len(ids)
            kv = res.kv[layer]
            assert kv.k.shape == (len(ids), cfg.num_key_value_heads, cfg.head_dim)
            np.testing.assert_array_equal(kv.positions, np.arange(len(ids)))
            assert np.abs(kv.k[-n:] - k_ref).max() < KV_TOL
            assert np.abs(kv.v[-n:] - v_ref).max() < KV_TOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_original_layout_is_bit_identical(name, checkpoints, engines):
    cfg = CONFIGS[name]
    original = PrefillEngine.from_checkpoint(checkpoints[name]["mxfp4"] + "/original", dtype="float32",
                                             progress=False, **TILES)
    assert original.cfg.num_hidden_layers == cfg.num_hidden_layers
    prompts = [random_prompt(cfg, n, seed=100 + n) for n in _lengths(cfg)]
    for a, b in zip(engines[(name, "mxfp4")].prefill(prompts), original.prefill(prompts)):
        np.testing.assert_array_equal(a.logits, b.logits)
        for layer in a.kv:
            np.testing.assert_array_equal(a.kv[layer].k, b.kv[layer].k)
            np.testing.assert_array_equal(a.kv[layer].v, b.kv[layer].v)


def test_sinks_matter_on_the_reference_path(checkpoints, engines):
    """The same weights with sinks +3 and −inf must give different logits (no path may silently drop sinks)."""
    import jax

    name = "A"
    cfg = CONFIGS[name]
    base = engines[(name, "mxfp4")]
    ids = random_prompt(cfg, 3 * cfg.sliding_window, seed=3)
    outs = []
    for s in (3.0, -np.inf):
        params = jax.tree.map(lambda a: a, base.params)
        params["layers"]["sinks"] = jax.numpy.full_like(params["layers"]["sinks"], s)
        eng = PrefillEngine(cfg, params, dtype="float32", **TILES)
        outs.append(eng.prefill([ids])[0].logits)
    assert np.all(np.isfinite(outs[1]))
    assert np.abs(outs[0] - outs[1]).max() > 1e-3
