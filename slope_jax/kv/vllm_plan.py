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
  published, so sliding layers need every token [start, n−1). A `last_window` export keeps sliding layers from
  `sliding_from` = max(0, n−W−(B_max−1)) (`kvfmt.kept_range`, B_max = `kvfmt.VLLM_BLOCK_MAX` = 128, the largest
  block size vLLM picks for gpt-oss): the block boundary at or before n−W for every block size B ≤ B_max, so under
  WINDOW and BLOCK it serves every prompt (n−1 tokens loaded, with prefix caching on or off: vLLM's defaults, no
  flag). Under ALL (the hybrid manager turned off) it serves a prompt only when n−W < B_max; with a block size above
  B_max, under BLOCK only when the boundary falls after `sliding_from`; otherwise the request is refused (export with
  kv_full) rather than publish unwritten slots. Exports written before `sliding_from` existed keep [n−W, n) only.
- Fails closed on identity (`check_identity`): an export is used only if its `model.weights_digest` equals the digest
  of the weights vLLM serves (the config fingerprint says nothing about the weight bytes: other weights of the same
  config would load and silently change vLLM's output), and only if it was computed for the request's `cache_salt`
  (its `prefix.identity` must equal the identity recomputed with the request's salt; an export without one serves
  unsalted requests only), so one tenant never receives another tenant's KV, as vLLM's own prefix cache shares
  nothing across salts. A missing or unknown digest refuses the export. A request that runs a LoRA adapter is refused
  every export: slope_jax computes the base model's KV (an export records no adapter), and vLLM's own prefix cache
  never shares blocks across adapters either.
- Every refusal is an `ExportRefused` whose message names the export, the field and both values; the connector
  logs it and lets vLLM prefill the request itself (0 external tokens, the status says why).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
import threading
import time

import numpy as np

from slope_jax.kv import compat
from slope_jax.kv import format as kvfmt
from slope_jax.kv import prefix as prefix_lib

# kv_transfer_params keys (the contract with slope_jax's prefill endpoint)
PATH_KEY = "slope_jax_kv_path"
FIRST_TOKEN_KEY = "slope_jax_first_token"
NUM_TOKENS_KEY = "num_tokens"
HASH_KEY = "token_ids_sha256"
# what the connector returns in the request's output kv_transfer_params
LOADED_KEY = "slope_jax_loaded_tokens"
STATUS_KEY = "slope_jax_status"
CACHE_HELD = "not needed: vLLM's prefix cache held the prompt's first n-1 tokens"  # a status: 0 tokens loaded

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
    `dtype`, and `sliding_from`, the first position its sliding layers hold (0 for `kv_full`, the manifest's
    `sliding_from` for `last_window`: `kvfmt.sliding_from`)."""

    path: str
    run_nonce: str
    checksums: dict
    num_tokens: int
    dtype: str
    sliding_from: int


def find_path(params: dict | None, prompt_hash: str, index: "ExportIndex | None") -> tuple[str | None, str]:
    """The export directory for a request: `kv_transfer_params[PATH_KEY]` if given, else the `index` entry of the
    prompt's token hash. Returns (path or None, how it was found / why none was)."""
    paths, how = find_paths(params, prompt_hash, index)
    return (paths[0] if paths else None), how


def find_paths(params: dict | None, prompt_hash: str, index: "ExportIndex | None",
               exclude: frozenset = frozenset()) -> tuple[list[str], str]:
    """The candidate export directories for a request: [kv_transfer_params[PATH_KEY]] if given, else every export
    of the prompt's token hash under `index` (several tenants or checkpoints may have exported the same prompt)
    not in `exclude`. Returns (paths, how they were found / why there are none)."""
    if params and params.get(PATH_KEY) is not None:
        path = params[PATH_KEY]
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ExportRefused(f"kv_transfer_params.{PATH_KEY}={path!r}: expected an absolute directory path")
        return ([] if path in exclude else [path]), f"kv_transfer_params.{PATH_KEY}"
    if index is None:
        return [], "no kv_transfer_params." + PATH_KEY + " and no kv_dir configured"
    paths = index.lookup_all(prompt_hash, exclude)
    if not paths:
        return [], f"no export of this prompt (token hash {prompt_hash[:12]}…) under kv_dir {index.kv_dir!r}"
    return paths, f"kv_dir index ({index.kv_dir})"


def choose(params: dict | None, prompt: np.ndarray, index: "ExportIndex | None", **validate_kwargs
           ) -> tuple[Validated | None, str]:
    """Find and validate the export serving `prompt` (`find_paths`, `validate` with `validate_kwargs`: cfg,
    cache_dtype, weights, cache_salt, ...): the first candidate that passes. Returns (export, how it was found) or
    (None, why there is none); raises ExportRefused with every candidate's reason if all were refused."""
    h = kvfmt.token_hash(prompt)
    refused: list[str] = []
    tried: set[str] = set()
    how = ""
    while True:
        paths, found = find_paths(params, h, index, frozenset(tried))
        if not paths:
            break
        how = found
        for path in paths:
            tried.add(path)
            try:
                return validate(path, prompt, params=params, **validate_kwargs), how
            except ExportRefused as e:
                refused.append(str(e))
    if refused:
        raise ExportRefused(refused[0] if len(refused) == 1 else
                            f"{len(refused)} exports of this prompt, none usable: " + "; ".join(refused))
    return None, found


def validate(path: str, prompt: np.ndarray, cfg, cache_dtype: str, params: dict | None, *, weights: str | None,
             weights_unknown: str = "", cache_salt: str | None = None, lora: str | None = None,
             verify_checksums: bool = True, check_fingerprint: bool = True) -> Validated:
    """Check that the export at `path` is this prompt's KV for this model, readable and complete.

    Args:
      path: export directory `<kv_dir>/<id>` (read through `slope_jax.kv.read_manifest` / `verify_files` only).
      prompt: int `[n]` token ids of the request.
      cfg: the decode engine's `ModelConfig` (`slope_jax.kv.model_config` of vLLM's hf_config).
      cache_dtype: vLLM's KV cache element type ("float32", "bfloat16", "float16"; others are refused).
      params: the request's kv_transfer_params; its NUM_TOKENS_KEY / HASH_KEY, when present, must agree too.
      weights: the digest of the weights vLLM serves (`served_weights`), None if unknown (`weights_unknown` says
        why): every export is then refused.
      cache_salt: the request's `cache_salt` (None or "" for none): the export must have been computed for it.
      lora: the name of the LoRA adapter the request runs (vLLM's `lora_request`), None for the base model: any
        adapter refuses the export (exports hold the base model's KV).
      verify_checksums: also compare each file's digest (sizes are always compared).
      check_fingerprint: also compare the model fingerprint (`slope_jax.kv.check_model`).
    Raises:
      ExportRefused naming the field: an inconsistent or unknown manifest, another model (layer count/kinds, KV
      heads, head_dim, window, fingerprint), other or unknown weights (`model.weights_digest`), another tenant
      (`cache_salt`), a LoRA adapter (`lora`), another prompt (length or token hash), a dtype the cache cannot hold
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
    check_identity(path, m, cfg, weights, cache_salt, weights_unknown=weights_unknown, lora=lora)
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
    return Validated(path, m["run_nonce"], m["checksums"], n, m["dtype"], kvfmt.sliding_from(m))


# What vLLM's gpt-oss model (vllm/model_executor/models/gpt_oss.py, 0.30-0.32) computes whatever the config says; the
# layer pattern (sliding on even layers) is checked per layer by the connector, from vLLM's own KV cache specs.
VLLM_GPT_OSS_FIXED = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702, "rms_norm_eps": 1e-5, "rope_type": "yarn"}


def vllm_model_differences(cfg) -> list[str]:
    """Where vLLM's gpt-oss model computes other than `cfg` (`ModelConfig`, as slope_jax and transformers follow it):
    each a sentence naming the field, the config's value and vLLM's. An export of such a checkpoint holds KV that vLLM
    would never compute, so none may be loaded (measured: swiglu_limit 0.5 → |Δ logprob| up to 0.86 against vLLM's
    own prefill). Empty for every released gpt-oss config."""
    out = []
    for field, fixed in VLLM_GPT_OSS_FIXED.items():
        value = getattr(cfg, field)
        if value != fixed:
            out.append(f"config {field} is {value!r}, vLLM's gpt-oss model uses {fixed!r} whatever the config says: "
                       "vLLM serves another model than the exports hold, so none is loaded")
    return out


def served_weights(model: str, configured: str | None = None) -> tuple[str | None, str]:
    """(digest of the weights vLLM serves, or None; why it is unknown). `configured`
    (kv_connector_extra_config.weights_digest) wins; else `weights_digest(model)` of vLLM's model directory, which
    must hold the *.safetensors files."""
    if configured is not None:
        if not isinstance(configured, str) or not configured:
            raise ValueError(f"kv_connector_extra_config.weights_digest={configured!r}: expected the hex digest "
                             "printed by slope_jax.checkpoints.digest.weights_digest(<checkpoint dir>)")
        return configured, ""
    if not os.path.isdir(model):
        return None, (f"vLLM's model {model!r} is not a local checkpoint directory: serve a directory or set "
                      "kv_connector_extra_config.weights_digest")
    try:
        return weights_digest(model), ""
    except OSError as e:
        return None, f"cannot digest vLLM's weights: {e}"


def weights_digest(path: str) -> str:
    """The digest of the weights vLLM serves from `path`: `slope_jax.kv.prefix.weights_digest`, the function the
    prefill engine records as `model.weights_digest` (XXH3-128 of the checkpoint's `*.safetensors` files).
    FileNotFoundError without one."""
    from slope_jax.kv.prefix import weights_digest as digest

    return digest(path)


def check_identity(path: str, m: dict, cfg, weights: str | None, cache_salt: str | None, *,
                   weights_unknown: str = "", lora: str | None = None) -> None:
    """Raise ExportRefused unless the export (manifest `m`) was computed with the weights vLLM serves (`weights`,
    its digest; None: unknown, `weights_unknown` says why), for the request's `cache_salt`, and the request runs no
    LoRA adapter (`lora`: its name, None for none) (module doc)."""
    if lora is not None:
        raise ExportRefused(f"{path}: lora: the request runs LoRA adapter {lora!r}, the export holds the base model's "
                            "KV (slope_jax computes no adapter): vLLM prefills it with the adapter")
    theirs = (m.get("model") or {}).get("weights_digest")
    if theirs is None:
        raise ExportRefused(f"{path}: model.weights_digest: the export does not record which weights computed it, "
                            f"vLLM serves {weights or 'weights of unknown digest'}: re-export it with this slope_jax")
    if weights is None:
        raise ExportRefused(f"{path}: model.weights_digest: the export was computed with weights {theirs}, the "
                            f"digest of the weights vLLM serves is unknown ({weights_unknown})")
    if theirs != weights:
        raise ExportRefused(f"{path}: model.weights_digest: the export was computed with weights {theirs}, vLLM "
                            f"serves weights {weights} (another checkpoint, maybe of the same config)")
    salt = cache_salt or None  # vLLM salts its own prefix cache only with a non-empty cache_salt
    pre = m.get("prefix")
    ident = pre.get("identity") if isinstance(pre, dict) else None
    if ident is None:
        if salt is not None:
            raise ExportRefused(f"{path}: cache_salt: the request has a cache_salt, the export records no "
                                "prefix.identity, so whose KV it is is unknown (export it with prefix reuse on)")
        return
    model = m.get("model") or {}

    def want(s):
        return prefix_lib.identity(fingerprint=model.get("fingerprint") or cfg.fingerprint(), weights=weights,
                                   dtype=m["dtype"], kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                   window=cfg.sliding_window, layer_types=cfg.layer_types, cache_salt=s)

    mine = want(salt)
    if ident != mine:
        if salt is None:
            whose = "the request has no cache_salt, the export was computed for one"
        elif ident == want(None):
            whose = "the request has a cache_salt, the export was computed without one"
        else:
            whose = "the export was computed for another cache_salt"
        raise ExportRefused(f"{path}: cache_salt: the export's prefix.identity {ident} is not the request's {mine} "
                            f"({whose}): KV is never shared across cache salts (tenants)")


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
        why = {BLOCK: "with prefix caching on, vLLM publishes the whole block holding position n−W as computed; an "
                      f"export covers blocks of up to {kvfmt.VLLM_BLOCK_MAX} tokens",
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
    """token_ids_sha256 → export directories, for the exports under `kv_dir` (`<kv_dir>/<id>`, ids not starting
    with '.'). Thread-safe.

    Kept current incrementally, so a lookup costs O(1) in vLLM's scheduler however many exports `kv_dir` holds:
    a lookup that finds no candidate looks again only if the directory changed (its mtime: every publication,
    replacement or removal renames or unlinks an entry in it), and then lists it and reads the manifests of the
    entries that are new or were replaced (another inode, or a new version directory of the id:
    `kv.format.publish` renames a new pointer over an id's),
    never every manifest (the listing itself is one `scandir`, about 1 ms per 2,000 entries). Each directory entry's
    manifest is read once (exports are published complete, `kv.format.publish`); one that cannot be read is not a
    candidate until it is replaced. A directory modified less than `RACY_S` ago is listed again at the next miss: a
    publication in the same timestamp tick as the last listing leaves the mtime unchanged (git's "racy" rule).
    `reads` counts manifest reads (for tests and logs)."""

    RACY_S = 2.0

    def __init__(self, kv_dir: str):
        self.kv_dir = os.fspath(kv_dir)
        self._by_hash: dict[str, list[str]] = {}
        self._entries: dict[str, tuple[int, str | None]] = {}  # name → (inode, token hash or None)
        self._versions: set[str] = set()  # version directory names at the last listing
        self._dir_mtime: int | None = None  # of the last listing, when it is safe to trust (not racy)
        self._lock = threading.Lock()
        self.reads = 0

    def lookup(self, token_hash: str) -> str | None:
        paths = self.lookup_all(token_hash)
        return paths[0] if paths else None

    def lookup_all(self, token_hash: str, exclude: frozenset = frozenset()) -> list[str]:
        """The existing export directories of `token_hash` (sorted by id) not in `exclude`; refreshes the index
        (`refresh`) once if there are none."""
        with self._lock:
            for scan in (False, True):
                if scan:
                    self._refresh()
                paths = [p for p in self._by_hash.get(token_hash, []) if p not in exclude and os.path.isdir(p)]
                if paths:
                    return paths
            return []

    def refresh(self) -> None:
        """Take in what changed under `kv_dir` since the last listing (nothing to do when its mtime is unchanged)."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        try:
            mtime = os.stat(self.kv_dir).st_mtime_ns
            if mtime == self._dir_mtime:
                return
            listed = {e.name: e.inode() for e in os.scandir(self.kv_dir)}
        except OSError:  # no kv_dir (yet): nothing to index
            return
        # trust this listing for the next misses only once no publication can share its timestamp tick
        self._dir_mtime = mtime if time.time_ns() - mtime > self.RACY_S * 1e9 else None
        # A re-export of an id publishes a version directory of a name never used before (`.v-<nonce>-<n>.<id>`):
        # its id's pointer is read again even if the inode number of the new pointer happens to be the old one's.
        versions = {name for name in listed if name.startswith(".v-")}
        renewed = {kvfmt.export_id(v) for v in versions - self._versions}
        self._versions = versions
        listed = {name: inode for name, inode in listed.items() if not name.startswith(".")}
        for gone in set(self._entries) - set(listed):
            self._unindex(gone)
        for name, inode in listed.items():
            if name in self._entries and self._entries[name][0] == inode and name not in renewed:
                continue  # the same directory entry as at the last listing: its manifest was read then
            self._unindex(name)
            self.reads += 1
            path = os.path.join(self.kv_dir, name)
            try:
                token_hash = kvfmt.read_manifest(path)["token_ids_sha256"]
            except (kvfmt.KVFormatError, OSError, KeyError, TypeError):
                token_hash = None  # broken or not an export: validate() reports why if a request names it explicitly
            self._entries[name] = (inode, token_hash)
            if token_hash is not None:
                bisect.insort(self._by_hash.setdefault(token_hash, []), path)

    def _unindex(self, name: str) -> None:
        inode, token_hash = self._entries.pop(name, (None, None))
        if token_hash is not None:
            paths = self._by_hash[token_hash]
            paths.remove(os.path.join(self.kv_dir, name))
            if not paths:
                del self._by_hash[token_hash]
