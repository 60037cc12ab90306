"""Write gpt-oss checkpoints in the released formats (for tests, benchmarks and the shipped tiny model).

Layouts (spec §3): "hf-mxfp4" — the released HF layout (`_blocks`/`_scales` experts, bf16 elsewhere, optionally
sharded with `model.safetensors.index.json`); "hf-dense" — HF's unquantized layout (`gate_up_proj [E, D, 2I]`,
`down_proj [E, I, D]`, as `save_pretrained` writes it); "original" — OpenAI's `original/` layout (fused qkv,
`block.N.…` names, `dtypes.json`). Every file is written to a temporary name and renamed; the index last.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from slope_jax.atomic import atomic_json, atomic_safetensors
from slope_jax.checkpoints.hf import HF_INDEX, HF_SINGLE
from slope_jax.model import mxfp4
from slope_jax.model.config import ModelConfig

BF16 = ml_dtypes.bfloat16


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Deterministic random parameters in the engine's layout (numpy; floats bf16, experts MXFP4).

    Scales keep activations O(1): projections ~ N(0, 1/D), sinks ~ N(0, 1), biases ~ N(0, 0.1²), MXFP4 scale bytes in
    [120, 122] (weights ~ 0.1). Every bias and sink is non-zero.
    """
    rng = np.random.default_rng(seed)
    L, D, N, K, H = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.head_dim
    E, I, V = cfg.num_experts, cfg.intermediate_size, cfg.vocab_size

    def n(*shape, std=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(BF16)

    layers = {
        "attn_norm": (1 + 0.1 * rng.standard_normal((L, D))).astype(BF16),
        "wq": n(L, N, H, D, std=D ** -0.5), "bq": n(L, N, H, std=0.1),
        "wk": n(L, K, H, D, std=D ** -0.5), "bk": n(L, K, H, std=0.1),
        "wv": n(L, K, H, D, std=D ** -0.5), "bv": n(L, K, H, std=0.1),
        "wo": n(L, D, N, H, std=(N * H) ** -0.5), "bo": n(L, D, std=0.1),
        "sinks": n(L, N, std=1.0),
        "mlp_norm": (1 + 0.1 * rng.standard_normal((L, D))).astype(BF16),
        "router_w": n(L, E, D, std=D ** -0.5), "router_b": n(L, E, std=0.1),
        "w1_blocks": rng.integers(0, 256, (L, E, 2 * I, D // 32, 16), dtype=np.uint8),
        "w1_scales": rng.integers(120, 123, (L, E, 2 * I, D // 32), dtype=np.uint8),
        "w2_blocks": rng.integers(0, 256, (L, E, D, I // 32, 16), dtype=np.uint8),
        "w2_scales": rng.integers(120, 123, (L, E, D, I // 32), dtype=np.uint8),
        "b1": n(L, E, 2 * I, std=0.1), "b2": n(L, E, D, std=0.1),
    }
    return {"embed": n(V, D), "layers": layers,
            "final_norm": (1 + 0.1 * rng.standard_normal(D)).astype(BF16), "unembed": n(V, D, std=D ** -0.5)}


def hf_tensors(cfg: ModelConfig, params: dict, experts: str = "mxfp4") -> dict[str, np.ndarray]:
    """Map engine-layout numpy params to HF tensor names ("mxfp4" packed or "dense" transposed experts)."""
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    p = params["layers"]
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"],
           "lm_head.weight": params["unembed"]}
    for l in range(L):
        pre = f"model.layers.{l}."
        out.update({
            pre + "input_layernorm.weight": p["attn_norm"][l],
            pre + "self_attn.q_proj.weight": p["wq"][l].reshape(-1, D),
            pre + "self_attn.q_proj.bias": p["bq"][l].reshape(-1),
            pre + "self_attn.k_proj.weight": p["wk"][l].reshape(-1, D),
            pre + "self_attn.k_proj.bias": p["bk"][l].reshape(-1),
            pre + "self_attn.v_proj.weight": p["wv"][l].reshape(-1, D),
            pre + "self_attn.v_proj.bias": p["bv"][l].reshape(-1),
            pre + "self_attn.o_proj.weight": p["wo"][l].reshape(D, -1),
            pre + "self_attn.o_proj.bias": p["bo"][l],
            pre + "self_attn.sinks": p["sinks"][l],
            pre + "post_attention_layernorm.weight": p["mlp_norm"][l],
            pre + "mlp.router.weight": p["router_w"][l],
            pre + "mlp.router.bias": p["router_b"][l],
            pre + "mlp.experts.gate_up_proj_bias": p["b1"][l],
            pre + "mlp.experts.down_proj_bias": p["b2"][l],
        })
        x = pre + "mlp.experts."
        if experts == "mxfp4":
            out.update({x + "gate_up_proj_blocks": p["w1_blocks"][l], x + "gate_up_proj_scales": p["w1_scales"][l],
                        x + "down_proj_blocks": p["w2_blocks"][l], x + "down_proj_scales": p["w2_scales"][l]})
        elif experts == "dense":
            dt = params["embed"].dtype
            w1 = mxfp4.decode_numpy(p["w1_blocks"][l], p["w1_scales"][l]).astype(dt)  # exact in bf16
            w2 = mxfp4.decode_numpy(p["w2_blocks"][l], p["w2_scales"][l]).astype(dt)
            out.update({x + "gate_up_proj": np.swapaxes(w1, 1, 2), x + "down_proj": np.swapaxes(w2, 1, 2)})
        else:
            raise ValueError(f"experts={experts!r}: expected 'mxfp4' or 'dense'")
    return out


def original_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Map engine-layout numpy params to OpenAI `original/` names (fused qkv, spec §3.2)."""
    D = cfg.hidden_size
    p = params["layers"]
    out = {"embedding.weight": params["embed"], "norm.scale": params["final_norm"],
           "unembedding.weight": params["unembed"]}
    for l in range(cfg.num_hidden_layers):
        pre = f"block.{l}."
        out.update({
            pre + "attn.norm.scale": p["attn_norm"][l],
            pre + "attn.qkv.weight": np.concatenate([p["wq"][l].reshape(-1, D), p["wk"][l].reshape(-1, D),
                                                     p["wv"][l].reshape(-1, D)]),
            pre + "attn.qkv.bias": np.concatenate([p["bq"][l].reshape(-1), p["bk"][l].reshape(-1),
                                                   p["bv"][l].reshape(-1)]),
            pre + "attn.sinks": p["sinks"][l],
            pre + "attn.out.weight": p["wo"][l].reshape(D, -1),
            pre + "attn.out.bias": p["bo"][l],
            pre + "mlp.norm.scale": p["mlp_norm"][l],
            pre + "mlp.gate.weight": p["router_w"][l],
            pre + "mlp.gate.bias": p["router_b"][l],
            pre + "mlp.mlp1_weight.blocks": p["w1_blocks"][l], pre + "mlp.mlp1_weight.scales": p["w1_scales"][l],
            pre + "mlp.mlp1_bias": p["b1"][l],
            pre + "mlp.mlp2_weight.blocks": p["w2_blocks"][l], pre + "mlp.mlp2_weight.scales": p["w2_scales"][l],
            pre + "mlp.mlp2_bias": p["b2"][l],
        })
    return out


def _shard_names(tensors: dict[str, np.ndarray], num_shards: int) -> list[list[str]]:
    """Split tensor names into `num_shards` groups of similar byte size, keeping insertion order."""
    names = list(tensors)
    total = sum(tensors[n].nbytes for n in names)
    groups: list[list[str]] = [[]]
    acc = 0
    for n in names:
        if acc >= total * len(groups) / num_shards and len(groups) < num_shards:
            groups.append([])
        groups[-1].append(n)
        acc += tensors[n].nbytes
    return groups


def write_hf(directory: str, cfg: ModelConfig, params: dict, *, experts: str = "mxfp4", num_shards: int = 1,
             generation_config: bool = True) -> None:
    """Write an HF-layout checkpoint: `config.json`, weights (one file, or `num_shards` files named
    `model-0000i-of-0000{n-1}.safetensors` + index, 0-based as released), `generation_config.json`."""
    os.makedirs(directory, exist_ok=True)
    tensors = hf_tensors(cfg, params, experts)
    import dataclasses
    c = dataclasses.replace(cfg, expert_format="mxfp4" if experts == "mxfp4" else "dense")
    if num_shards <= 1:
        atomic_safetensors(os.path.join(directory, HF_SINGLE), tensors, {"format": "pt"})
    else:
        weight_map = {}
        groups = _shard_names(tensors, num_shards)
        for i, names in enumerate(groups):
            fname = f"model-{i:05d}-of-{len(groups) - 1:05d}.safetensors"
            atomic_safetensors(os.path.join(directory, fname), {n: tensors[n] for n in names}, {"format": "pt"})
            weight_map.update({n: fname for n in names})
        total = int(sum(t.nbytes for t in tensors.values()))
        atomic_json(os.path.join(directory, HF_INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
    if generation_config:
        gen = {"bos_token_id": None, "eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.pad_token_id,
               "do_sample": False}
        atomic_json(os.path.join(directory, "generation_config.json"), gen)
    atomic_json(os.path.join(directory, "config.json"), c.to_hf_dict())


def write_original(directory: str, cfg: ModelConfig, params: dict) -> None:
    """Write OpenAI's layout into `directory` (typically `<checkpoint>/original`): config.json, dtypes.json,
    model.safetensors."""
    os.makedirs(directory, exist_ok=True)
    tensors = original_tensors(cfg, params)
    atomic_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    dtypes = {n: ("FP4" if n.endswith(".blocks") else "UE8" if n.endswith(".scales") else "BF16") for n in tensors}
    atomic_json(os.path.join(directory, "dtypes.json"), dtypes)
    atomic_json(os.path.join(directory, "config.json"), cfg.to_original_dict())
