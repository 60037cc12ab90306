"""KV cache export format and reader (`slope_jax.kv`), readable with numpy + safetensors + ml_dtypes alone (no JAX).

`slope_jax.kv.decode` (a reference decode step over an export) needs JAX and is imported explicitly.
`to_transformers_cache` (an export as a Hugging Face transformers cache) imports torch and transformers on call.
`check_model` / `KVModelMismatch`: is an export the decode model's KV? (docs/kv-format.md describes the format.)
"""

# bfloat16 exports: safetensors' numpy reader needs numpy to know the 'bfloat16' dtype, which ml_dtypes registers on
# import (JAX imports it too, so only JAX-free readers — a decode engine — would otherwise fail on every bf16 export).
import ml_dtypes  # noqa: F401

from slope_jax.kv.compat import KVModelMismatch, check_model, model_config
from slope_jax.kv.format import (
                                 AXES,
                                 FORMAT,
                                 MANIFEST,
                                 READ_VERSIONS,
                                 VERSION,
                                 ExportExistsError,
                                 KVExistsError,
                                 KVFormatError,
                                 LayerKV,
                                 check_target,
                                 collect,
                                 export_id,
                                 kept_range,
                                 load,
                                 new_run_nonce,
                                 publish,
                                 read_manifest,
                                 resolve,
                                 runs,
                                 segment_name,
                                 staging_dir,
                                 token_hash,
                                 verify_files,
                                 write_manifest,
                                 write_shard_file,
)

__all__ = ["AXES", "FORMAT", "MANIFEST", "READ_VERSIONS", "VERSION", "ExportExistsError", "KVExistsError",
           "KVFormatError", "KVModelMismatch", "LayerKV", "check_model", "check_target", "collect",
           "export_id", "kept_range", "load", "model_config", "new_run_nonce", "publish", "read_manifest", "resolve",
           "runs", "segment_name", "staging_dir", "to_transformers_cache", "token_hash",
           "verify_files", "write_manifest", "write_shard_file"]


def to_transformers_cache(path, config, **kwargs):
    """An export as a transformers `DynamicCache` for `GptOssForCausalLM`; see
    `slope_jax.kv.transformers.to_transformers_cache` (imported here on call: torch and transformers stay optional)."""
    from slope_jax.kv.transformers import to_transformers_cache as build

    return build(path, config, **kwargs)
