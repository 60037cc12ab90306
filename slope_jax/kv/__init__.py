"""KV cache export format and reader (`slope_jax.kv`), readable with numpy + safetensors + ml_dtypes alone (no JAX).

`slope_jax.kv.decode` (a reference decode step over an export) needs JAX and is imported explicitly.
"""

from slope_jax.kv.format import (
                                 AXES,
                                 FORMAT,
                                 MANIFEST,
                                 VERSION,
                                 ExportExistsError,
                                 KVFormatError,
                                 LayerKV,
                                 check_target,
                                 clean_stale,
                                 kept_range,
                                 load,
                                 new_run_nonce,
                                 publish,
                                 read_manifest,
                                 runs,
                                 segment_name,
                                 staging_dir,
                                 token_hash,
                                 verify_files,
                                 write_manifest,
                                 write_shard_file,
)

__all__ = ["AXES", "FORMAT", "MANIFEST", "VERSION", "ExportExistsError", "KVFormatError", "LayerKV", "check_target",
           "clean_stale", "kept_range", "load", "new_run_nonce", "publish", "read_manifest", "runs", "segment_name",
           "staging_dir", "token_hash", "verify_files", "write_manifest", "write_shard_file"]
