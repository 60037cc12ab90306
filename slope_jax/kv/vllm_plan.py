"""What the vLLM connector decides, without vLLM: which export serves a prompt, whether it may be used, and into
which cache slots each layer's rows go. (`slope_jax.kv.vllm_connector` is the vLLM glue around these functions;
keeping them here lets the main test suite check them without a vLLM install.)

Notable:
- vLLM must compute the prompt's last token itself (it samples the first token from it), so a prompt of n tokens
  loads n−1 external tokens: positions [start, n−1), `start` being vLLM's own (block-aligned) prefix-cache hit.
- What a sliding layer needs depends on vLLM's KV cache manager and prefix caching (`layer_rows`):
  WINDOW (prefix caching off): keys position n−1 attends to, [max(start, n−W), n−1) (docs/model.md §2.3); earlier slots
  are either the null block (hybrid manager) or never read (plain manager: masked by the window, never reused).
  BLOCK (prefix caching on, hybrid manager): vLLM publishes every full non-null block as computed, and a later
  request with the same prefix may hit one and attend to all its slots, so the block holding n−W must be filled
  from its first slot: [max(start, ⌊(n−W)/B⌋·B), n−1). ALL (prefix caching on, plain manager): every block is
  published, so sliding layers need every token [start, n−1). A `last_window` export keeps [n−W, n) only: under BLOCK
  it serves a prompt only when n−W is block-aligned or n ≤ W, under ALL only when n ≤ W; otherwise the request is
  refused (export with kv_full, or turn prefix caching off on the decode engine) rather than publish unwritten slots.
- Every refusal is an `ExportRefused` whose message names the export, the field and both values; the connector
  logs it and lets vLLM prefill the request itself.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np

from slope_jax.kv import compat
from slope_jax.kv import format as kvfmt

# kv_transfer_params keys (the contract with slope_jax's prefill endpoint)
PATH_KEY = "slope_jax_kv_path"
FIRST_TOKEN_KEY = "slope_jax_first_token"
NUM_TOKENS_KEY = "num_tokens"
HASH_KEY = "token_ids_sha256"
# what the connector returns in the request's output kv_transfer_params
LOADED_KEY = "slope_jax_loaded_tokens"
STATUS_KEY = "slope_jax_status"

# how sliding layers are filled (module doc)
WINDOW, BLOCK, ALL = "window", "block", "all"

# widening casts are exact; anything else would change the numbers the prefill computed
_EXACT_CASTS = {("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
                ("bfloat16", "float32"), ("float16", "float32")}


class ExportRefused(Exception):
    """An export cannot serve a request; the message says why (the connector logs it, vLLM prefills)."""


@dataclasses.dataclass(frozen=True)
class Validated:
    """An export that passed every check for one prompt: `path` (the resolved, immutable directory), its manifest's
    `run_nonce` and `checksums` (the worker re-reads the manifest and refuses a different one), `num_tokens` n, its
    `dtype`, and `sliding_from`, the first position its sliding layers hold (0 for `kv_full`, max(0, n−W) for
    `last_window`)."""

    path: str
    run_nonce: str
    checksums: dict
    num_tokens: int
    dtype: str
    sliding_from: int


def find_path(params: dict | None, prompt_hash: str, index: "ExportIndex | None") -> tuple[str | None, str]:
    """The export directory for a request: `kv_transfer_params[PATH_KEY]` if given, else the `index` entry of the
    prompt's token hash. Returns (path or None, how it was found / why none was)."""
    if params and params.get(PATH_KEY) is not None:
        path = params[PATH_KEY]
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ExportRefused(f"kv_transfer_params.{PATH_KEY}={path!r}: expected an absolute directory path")
        return path, f"kv_transfer_params.{PATH_KEY}"
    if index is None:
        return None, "no kv_transfer_params." + PATH_KEY + " and no kv_dir configured"
    path = index.lookup(prompt_hash)
    if path is None:
        return None, f"no export of this prompt (token hash {prompt_hash[:12]}…) under kv_dir {index.kv_dir!r}"
    return path, f"kv_dir index ({index.kv_dir})"


def validate(path: str, prompt: np.ndarray, cfg, cache_dtype: str, params: dict | None, *,
             verify_checksums: bool = True, check_fingerprint: bool = True) -> Validated:
    """Check that the export at `path` is this prompt's KV for this model, readable and complete.

    Args:
      path: export directory `<kv_dir>/<id>` (read through `slope_jax.kv.read_manifest` / `verify_files` only).
      prompt: int `[n]` token ids of the request.
      cfg: the decode engine's `ModelConfig` (`slope_jax.kv.model_config` of vLLM's hf_config).
      cache_dtype: vLLM's KV cache element type ("float32", "bfloat16", "float16"; others are refused).
      params: the request's kv_transfer_params; its NUM_TOKENS_KEY / HASH_KEY, when present, must agree too.
      verify_checksums: also compare each file's SHA-256 (sizes are always compared).
      check_fingerprint: also compare the model fingerprint (`slope_jax.kv.check_model`).
    Raises:
      ExportRefused naming the field: an inconsistent or unknown manifest, another model (layer count/kinds, KV
      heads, head_dim, window, fingerprint), another prompt (length or token hash), a dtype the cache cannot hold
      exactly, a missing/short/modified file. (Whether the sliding layers hold enough tokens depends on the request's
      local prefix hit: `check_sliding`.)
    """
    try:
        # Resolve the export once (a pointer to an immutable version directory from format 3 on; a plain directory is
        # itself): validation and the worker's read then see the same files even if the id is re-exported meanwhile.
        path = getattr(kvfmt, "resolve", os.path.realpath)(path)
        m = kvfmt.read_manifest(path)
        compat.check_model(m, cfg, path, check_fingerprint=check_fingerprint)
    except kvfmt.KVFormatError as e:
        raise ExportRefused(str(e)) from None
    n = len(prompt)
    if m["num_tokens"] != n:
        raise ExportRefused(f"{path}: num_tokens: the export holds {m['num_tokens']} tokens, the prompt has {n}")
    want_hash = kvfmt.token_hash(prompt)
    if m["token_ids_sha256"] != want_hash:
        raise ExportRefused(f"{path}: token_ids_sha256: {m['token_ids_sha256']} in the export, {want_hash} for the "
                            "prompt (another prompt's KV)")
    if params:
        if params.get(NUM_TOKENS_KEY) is not None and params[NUM_TOKENS_KEY] != n:
            raise ExportRefused(f"kv_transfer_params.{NUM_TOKENS_KEY}={params[NUM_TOKENS_KEY]!r}, the prompt has "
                                f"{n} tokens")
        if params.get(HASH_KEY) is not None and params[HASH_KEY] != want_hash:
            raise ExportRefused(f"kv_transfer_params.{HASH_KEY}={params[HASH_KEY]!r} is not the prompt's token hash "
                                f"{want_hash}")
        first = params.get(FIRST_TOKEN_KEY)
        if first is not None and m.get("first_token") is not None and first != m["first_token"]:
            raise ExportRefused(f"kv_transfer_params.{FIRST_TOKEN_KEY}={first!r}, the export's first_token is "
                                f"{m['first_token']!r}")
    if (m["dtype"], cache_dtype) not in _EXACT_CASTS:
        raise ExportRefused(f"{path}: dtype: the export is {m['dtype']}, vLLM's KV cache is {cache_dtype}: only exact "
                            "(equal or widening) conversions are done")
    try:
        kvfmt.verify_files(path, m, hashes=verify_checksums)
    except kvfmt.KVFormatError as e:
        raise ExportRefused(str(e)) from None
    sliding_from = kvfmt.kept_range(n, kvfmt.SLIDING, cfg.sliding_window, m["sliding_policy"] == "full")[0]
    return Validated(path, m["run_nonce"], m["checksums"], n, m["dtype"], sliding_from)


def layer_rows(kind: str, start: int, n: int, window: int, block_size: int, mode: str) -> tuple[int, int]:
    """Token range [lo, hi) a layer of `kind` is given for a prompt of `n` tokens whose first `start` tokens vLLM
    already holds: hi = n−1 (vLLM computes the last token); a full layer, or a sliding layer under ALL, starts at
    `start`; a sliding layer under WINDOW at n−W, under BLOCK at the start of the block (of `block_size` tokens) that
    holds n−W (module doc)."""
    hi = n - 1
    lo = start
    if kind == kvfmt.SLIDING and mode != ALL:
        first = max(0, n - window)
        if mode == BLOCK:
            first = first // block_size * block_size
        elif mode != WINDOW:
            raise ValueError(f"mode={mode!r}: expected {WINDOW!r}, {BLOCK!r} or {ALL!r}")
        lo = max(start, first)
    return min(lo, hi), hi


def check_sliding(export: Validated, lo: int, hi: int, mode: str) -> None:
    """Raise ExportRefused if the export's sliding layers do not hold positions [lo, hi) (`layer_rows`)."""
    if hi > lo and lo < export.sliding_from:
        why = {BLOCK: "with prefix caching on, vLLM publishes the whole block holding position n−W as computed",
               ALL: "with prefix caching on and the plain KV manager, vLLM publishes every token's block as computed",
               WINDOW: "they are the keys the last prompt token attends to"}[mode]
        raise ExportRefused(
            f"{export.path}: sliding_policy: sliding layers hold tokens [{export.sliding_from}, {export.num_tokens}), "
            f"vLLM needs [{lo}, {hi}) ({why}): export with kv_full, or turn prefix caching off on the decode engine")


def slots(block_ids: list[int], block_size: int, lo: int, hi: int, null_block: int | None) -> np.ndarray:
    """int64 `[hi − lo]` cache slots of token positions lo … hi−1: block_ids[t // B] · B + t mod B (vLLM's slot
    mapping). Raises ExportRefused if a position has no block or lands in the null block (the KV manager did not
    allocate what the plan needs)."""
    t = np.arange(lo, hi, dtype=np.int64)
    if hi > lo and (hi - 1) // block_size >= len(block_ids):
        raise ExportRefused(f"token {hi - 1} needs block {(hi - 1) // block_size}, the request has {len(block_ids)}")
    blocks = np.asarray(block_ids, dtype=np.int64)[t // block_size] if hi > lo else np.zeros(0, np.int64)
    if null_block is not None and np.any(blocks == null_block):
        bad = int(t[np.argmax(blocks == null_block)])
        raise ExportRefused(f"token {bad} maps to the null block: vLLM allocated no cache for it")
    return blocks * block_size + t % block_size


class ExportIndex:
    """token_ids_sha256 → export directory, for the exports under `kv_dir` (`<kv_dir>/<id>`, ids not starting with
    '.'). Built from each export's manifest (`slope_jax.kv.read_manifest`); rescanned when a lookup misses, so an
    export published after start-up is found. Thread-safe."""

    def __init__(self, kv_dir: str):
        self.kv_dir = os.fspath(kv_dir)
        self._by_hash: dict[str, str] = {}
        self._lock = threading.Lock()

    def lookup(self, token_hash: str) -> str | None:
        with self._lock:
            path = self._by_hash.get(token_hash)
            if path is not None and os.path.isdir(path):
                return path
            self._scan()
            return self._by_hash.get(token_hash)

    def _scan(self) -> None:
        try:
            names = os.listdir(self.kv_dir)
        except FileNotFoundError:
            return
        for name in names:
            if name.startswith("."):
                continue
            path = os.path.join(self.kv_dir, name)
            try:
                m = kvfmt.read_manifest(path)
            except (kvfmt.KVFormatError, OSError):
                continue  # unfinished or broken: validate() reports why if a request names it explicitly
            self._by_hash[m["token_ids_sha256"]] = path
