"""gpt-oss model configuration: one frozen dataclass, built from a Hugging Face or an OpenAI `original/` config.

Notable:
- Both `config.json` dialects map onto the same fields (docs/model.md §1: `num_local_experts` ↔ `num_experts`,
  `beta_fast` ↔ `rope_ntk_beta`, `beta_slow` ↔ `rope_ntk_alpha`, `original_max_position_embeddings` ↔
  `initial_context_length`). transformers ≥ 5 writes `rope_parameters` instead of `rope_scaling`; both are read.
- Validation happens once, here, with errors that name the field, its value and the rule it broke.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Literal

SLIDING = "sliding_attention"
FULL = "full_attention"
_LAYER_KINDS = (SLIDING, FULL)


class ConfigError(ValueError):
    """A configuration value breaks a rule of the model; the message names the field and the rule."""


# a converted checkpoint's marker (written last by checkpoints.orbax_store.save): holds its config, among others
CONVERTED_MARKER = "slope_jax_orbax.json"

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """gpt-oss hyper-parameters (docs/model.md §1). Sizes: counts; `sliding_window` is in tokens (keys seen by a query,
    itself included); `rope_*` follow YaRN (Peng et al. 2023, arXiv:2309.00071) in gpt-oss (docs/model.md §2.2)."""

    num_hidden_layers: int
    num_experts: int
    experts_per_token: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_theta: float = 150000.0
    rope_type: Literal["yarn", "default"] = "yarn"
    rope_scaling_factor: float = 32.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_original_max_position_embeddings: int = 4096
    rope_truncate: bool = False
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # How the checkpoint stores expert weights: "mxfp4" (packed uint8 blocks + E8M0 scales, docs/model.md §3.3) or
    # "dense" (unquantized floats). The loader sets it from the tensors it finds.
    expert_format: Literal["mxfp4", "dense"] = "mxfp4"

    def __post_init__(self):
        _validate(self)

    # ----------------------------------------------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        """Whether global layer `layer` uses the sliding window (docs/model.md §1: even layers in the releases)."""
        return self.layer_types[layer] == SLIDING

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)


    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    def fingerprint(self) -> str:
        """A stable hash of the math-relevant fields (for KV export manifests)."""
        import hashlib

        d = self.to_dict()
        d.pop("expert_format")  # storage, not math
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    # ----------------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face gpt-oss `config.json` dict. Raises ConfigError naming `source` and the field."""
        try:
            n_layers = _req(d, "num_hidden_layers", source)
            layer_types = d.get("layer_types")
            if layer_types is None:  # HF derives the same alternating pattern (docs/model.md §1)
                layer_types = [SLIDING if i % 2 == 0 else FULL for i in range(n_layers)]
            rope = d.get("rope_scaling") or d.get("rope_parameters") or {
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 4096, "truncate": False}
            rope_type = rope.get("rope_type", rope.get("type", "yarn"))
            eos = d.get("eos_token_id")
            eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            quant = (d.get("quantization_config") or {}).get("quant_method")
            return cls(
                num_hidden_layers=n_layers,
                num_experts=_req(d, "num_local_experts", source, alt="num_experts"),
                experts_per_token=_req(d, "num_experts_per_tok", source, alt="experts_per_token"),
                vocab_size=_req(d, "vocab_size", source),
                hidden_size=_req(d, "hidden_size", source),
                intermediate_size=_req(d, "intermediate_size", source),
                num_attention_heads=_req(d, "num_attention_heads", source),
                num_key_value_heads=_req(d, "num_key_value_heads", source),
                # absent: transformers' GptOssConfig defaults (64 and 128), which vLLM reads too; not hidden/heads
                head_dim=d.get("head_dim") or 64,
                sliding_window=_window(d, source),
                layer_types=tuple(layer_types),
                rope_theta=_number(d if "rope_theta" in d else rope, "rope_theta", 150000.0, source),
                rope_type=rope_type,
                rope_scaling_factor=_number(rope, "factor", None if rope_type == "yarn" else 1.0, source, "rope "),
                rope_beta_fast=_number(rope, "beta_fast", 32.0, source, "rope "),
                rope_beta_slow=_number(rope, "beta_slow", 1.0, source, "rope "),
                rope_original_max_position_embeddings=_number(
                    rope, "original_max_position_embeddings", d.get("max_position_embeddings", 4096), source, "rope ",
                    int),
                rope_truncate=bool(rope.get("truncate", True)),
                max_position_embeddings=_number(d, "max_position_embeddings", 131072, source, kind=int),
                rms_norm_eps=_number(d, "rms_norm_eps", 1e-5, source),
                swiglu_limit=_number(d, "swiglu_limit", 7.0, source),
                swiglu_alpha=_number(d, "swiglu_alpha", 1.702, source),
                eos_token_ids=eos,
                pad_token_id=d.get("pad_token_id"),
                expert_format="mxfp4" if quant == "mxfp4" else "dense",
            )._checked_extra(d, source)
        except ConfigError:
            raise
        except (TypeError, ValueError, KeyError) as e:
            raise ConfigError(f"{source}: {e}") from e

    @classmethod
    def from_original_dict(cls, d: dict[str, Any], *, source: str = "original/config.json") -> ModelConfig:
        """Build from OpenAI's `original/config.json` (docs/model.md §1 key mapping). Always MXFP4 experts, YaRN."""
        n_layers = _req(d, "num_hidden_layers", source)
        context = _number(d, "initial_context_length", 4096, source, kind=int)
        factor = _number(d, "rope_scaling_factor", 32.0, source)  # absent: OpenAI's reference default (YaRN)
        return cls(
            num_hidden_layers=n_layers,
            num_experts=_req(d, "num_experts", source),
            experts_per_token=_req(d, "experts_per_token", source),
            vocab_size=_req(d, "vocab_size", source),
            hidden_size=_req(d, "hidden_size", source),
            intermediate_size=_req(d, "intermediate_size", source),
            num_attention_heads=_req(d, "num_attention_heads", source),
            num_key_value_heads=_req(d, "num_key_value_heads", source),
            head_dim=_req(d, "head_dim", source),
            sliding_window=_req(d, "sliding_window", source),
            layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(n_layers)),
            rope_theta=_number(d, "rope_theta", 150000.0, source),
            rope_type="yarn" if factor != 1.0 else "default",
            rope_scaling_factor=factor,
            rope_beta_fast=_number(d, "rope_ntk_beta", 32.0, source),
            rope_beta_slow=_number(d, "rope_ntk_alpha", 1.0, source),
            rope_original_max_position_embeddings=context,
            rope_truncate=False,
            max_position_embeddings=_number(d, "max_position_embeddings", int(context * factor), source, kind=int),
            swiglu_limit=_number(d, "swiglu_limit", 7.0, source),
            expert_format="mxfp4",
        )

    @classmethod
    def from_fields(cls, d: dict[str, Any]) -> ModelConfig:
        """The inverse of `to_dict` (JSON lists back to tuples): how a converted checkpoint's marker stores it."""
        return cls(**{**d, "layer_types": tuple(d["layer_types"]), "eos_token_ids": tuple(d["eos_token_ids"])})

    @classmethod
    def from_converted(cls, path: str | os.PathLike) -> ModelConfig | None:
        """The config of a checkpoint directory written by `slope_jax.convert` (its `CONVERTED_MARKER` holds it; no
        config.json there), or None when `path` is not one."""
        marker = os.path.join(os.fspath(path), CONVERTED_MARKER)
        if not os.path.isfile(marker):
            return None
        with open(marker) as f:
            return cls.from_fields(json.load(f)["config"])

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> ModelConfig:
        """Read a config file in either dialect (an OpenAI config has `num_experts` and no `model_type`)."""
        path = os.fspath(path)
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a JSON object, found {type(d).__name__}")
        if "model_type" not in d and "num_experts" in d and "num_local_experts" not in d:
            return cls.from_original_dict(d, source=path)
        if d.get("model_type", "gpt_oss") != "gpt_oss":
            raise ConfigError(f"{path}: model_type={d['model_type']!r}, expected 'gpt_oss'")
        return cls.from_hf_dict(d, source=path)

    def to_hf_dict(self) -> dict[str, Any]:
        """The released-layout `config.json` (docs/model.md §1) for this configuration."""
        d = {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "num_hidden_layers": self.num_hidden_layers,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token,
            "experts_per_token": self.experts_per_token,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "rope_theta": self.rope_theta,
            "rope_scaling": ({"rope_type": "yarn", "factor": self.rope_scaling_factor,
                              "beta_fast": self.rope_beta_fast, "beta_slow": self.rope_beta_slow,
                              "original_max_position_embeddings": self.rope_original_max_position_embeddings,
                              "truncate": self.rope_truncate} if self.rope_type == "yarn" else None),
            "max_position_embeddings": self.max_position_embeddings,
            "initial_context_length": self.rope_original_max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "swiglu_limit": self.swiglu_limit,
            "attention_bias": True,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "router_aux_loss_coef": 0.9,
            "output_router_logits": False,
            "initializer_range": 0.02,
            "use_cache": True,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
        }
        if self.expert_format == "mxfp4":
            d["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}
        return d

    def to_original_dict(self) -> dict[str, Any]:
        """OpenAI's `original/config.json` (docs/model.md §1 key list).

        Raises ConfigError naming each field the format cannot carry — those that `from_original_dict` would read
        back as another value (layer_types other than sliding on even layers, YaRN `truncate`, a
        max_position_embeddings other than initial_context_length × rope_scaling_factor, rms_norm_eps,
        swiglu_alpha): written anyway, that directory would load as another model, silently."""
        d = self._original_keys()
        back = ModelConfig.from_original_dict(d)
        lost = [f"{f.name}={getattr(self, f.name)!r} (it would read back as {getattr(back, f.name)!r})"
                for f in dataclasses.fields(self) if f.name not in _NOT_IN_ORIGINAL
                and getattr(back, f.name) != getattr(self, f.name)]
        if lost:
            raise ConfigError("OpenAI's original/config.json cannot express this config: " + "; ".join(lost))
        return d

    def _original_keys(self) -> dict[str, Any]:
        return {
            "num_hidden_layers": self.num_hidden_layers, "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "swiglu_limit": self.swiglu_limit, "head_dim": self.head_dim,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "sliding_window": self.sliding_window,
            "initial_context_length": self.rope_original_max_position_embeddings,
            "rope_theta": self.rope_theta, "rope_scaling_factor": self.rope_scaling_factor,
            "rope_ntk_alpha": self.rope_beta_slow, "rope_ntk_beta": self.rope_beta_fast,
        }

    def _checked_extra(self, d: dict[str, Any], source: str) -> ModelConfig:
        """Fields of the HF dialect that this engine does not implement are rejected, not ignored."""
        if d.get("attention_bias", True) is not True:
            raise ConfigError(f"{source}: attention_bias={d['attention_bias']!r}; gpt-oss has q/k/v/o biases "
                              "(docs/model.md §2), only attention_bias=true is supported")
        if d.get("tie_word_embeddings", False):
            raise ConfigError(f"{source}: tie_word_embeddings=true; gpt-oss unembedding is untied (docs/model.md §2.3)")
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        # YaRN options transformers applies that this engine does not: refused, never silently computed otherwise
        for key, neutral in (("attention_factor", None), ("partial_rotary_factor", 1.0), ("mscale", None),
                             ("mscale_all_dim", None)):
            if rope.get(key, neutral) not in (neutral, None) or d.get(key, neutral) not in (neutral, None):
                raise ConfigError(f"{source}: rope {key}={rope.get(key, d.get(key))!r} is not supported (gpt-oss's "
                                  f"YaRN has none; docs/model.md §2.2)")
        return self


# what an original/ directory does not hold in its config.json: generation settings (generation_config.json) and the
# expert storage (always MXFP4 there; the writer quantizes)
_NOT_IN_ORIGINAL = frozenset({"eos_token_ids", "pad_token_id", "expert_format"})


def _number(d: dict[str, Any], key: str, default, source: str, where: str = "", kind=float):
    """`d[key]` as `kind` (float or int), `default` when absent; ConfigError naming the key when it is null, not a
    number, or absent with no default (a YaRN rope without `factor`: transformers refuses it too)."""
    if key not in d and default is None:
        raise ConfigError(f"{source}: {where}{key} is required (no default)")
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and not (math.isfinite(value) and value == int(value))):
        raise ConfigError(f"{source}: {where}{key}={value!r} must be {'an integer' if kind is int else 'a number'}")
    return kind(value)


def _window(d: dict[str, Any], source: str) -> int:
    """`sliding_window`: absent → 128 (transformers' default); an explicit null is refused: transformers then builds
    its sliding layers' masks without a window, which this engine does not model."""
    if "sliding_window" not in d:
        return 128
    if d["sliding_window"] is None and SLIDING in (d.get("layer_types") or [SLIDING]):
        raise ConfigError(f"{source}: sliding_window=null is not supported (gpt-oss's sliding layers have a window; "
                          "give one, or make every layer full_attention in layer_types)")
    return 128 if d["sliding_window"] is None else d["sliding_window"]  # null with no sliding layer: unused


def _req(d: dict[str, Any], key: str, source: str, alt: str | None = None):
    if key in d:
        return d[key]
    if alt is not None and alt in d:
        return d[alt]
    raise ConfigError(f"{source}: required field {key!r} is missing" + (f" (also looked for {alt!r})" if alt else ""))


def _validate(c: ModelConfig) -> None:
    def positive(name: str):
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{name}={v!r}: must be a positive integer")

    for name in ("num_hidden_layers", "num_experts", "experts_per_token", "vocab_size", "hidden_size",
                 "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                 "rope_original_max_position_embeddings", "max_position_embeddings"):
        positive(name)
    if c.num_attention_heads % c.num_key_value_heads:
        raise ConfigError(f"num_attention_heads={c.num_attention_heads} must be divisible by "
                          f"num_key_value_heads={c.num_key_value_heads} (GQA groups)")
    if c.head_dim % 2:
        raise ConfigError(f"head_dim={c.head_dim} must be even (RoPE rotates two halves, docs/model.md §2.2)")
    if c.experts_per_token > c.num_experts:
        raise ConfigError(f"experts_per_token={c.experts_per_token} exceeds num_experts={c.num_experts}")
    if len(c.layer_types) != c.num_hidden_layers:
        raise ConfigError(f"layer_types has {len(c.layer_types)} entries, num_hidden_layers={c.num_hidden_layers}")
    for i, t in enumerate(c.layer_types):
        if t not in _LAYER_KINDS:
            raise ConfigError(f"layer_types[{i}]={t!r}: must be one of {_LAYER_KINDS}")
    if c.rope_type not in ("yarn", "default"):
        raise ConfigError(f"rope_type={c.rope_type!r}: supported rope types are 'yarn' and 'default'")
    if c.rope_type == "yarn" and not c.rope_scaling_factor >= 1.0:
        raise ConfigError(f"rope_scaling_factor={c.rope_scaling_factor}: YaRN needs a factor >= 1")
    if not (c.rope_theta > 1.0 and math.isfinite(c.rope_theta)):
        raise ConfigError(f"rope_theta={c.rope_theta}: must be a finite number > 1")
    if not c.rms_norm_eps > 0:
        raise ConfigError(f"rms_norm_eps={c.rms_norm_eps}: must be > 0")
    if not c.swiglu_limit > 0:
        raise ConfigError(f"swiglu_limit={c.swiglu_limit}: must be > 0")
    if c.expert_format not in ("mxfp4", "dense"):
        raise ConfigError(f"expert_format={c.expert_format!r}: must be 'mxfp4' or 'dense'")
    if c.expert_format == "mxfp4":
        for name in ("hidden_size", "intermediate_size"):
            if getattr(c, name) % 32:
                raise ConfigError(f"{name}={getattr(c, name)} must be a multiple of 32: MXFP4 blocks cover 32 "
                                  "input channels (docs/model.md §3.3)")
    for t in c.eos_token_ids:
        if not 0 <= t < c.vocab_size:
            raise ConfigError(f"eos_token_id {t} is outside the vocabulary [0, {c.vocab_size})")
