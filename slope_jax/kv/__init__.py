"""KV cache export format and reader (`slope_jax.kv`), readable with numpy + safetensors alone (no JAX).

`slope_jax.kv.decode` (a reference decode step over an export) needs JAX and is imported explicitly.
"""

from slope_jax.kv.format import (
                                 AXES,
                                 FORMAT,
                                 MANIFEST,
                                 VERSION,
                                 KVFormatError,
                                 LayerKV,
                                 kept_range,
                                 load,
                                 read_manifest,
                                 runs,
                                 segment_name,
                                 token_hash,
                                 write_manifest,
                                 write_shard_file,
)

__all__ = ["AXES", "FORMAT", "MANIFEST", "VERSION", "KVFormatError", "LayerKV", "kept_range", "load", "read_manifest",
           "runs", "segment_name", "token_hash", "write_manifest", "write_shard_file"]
