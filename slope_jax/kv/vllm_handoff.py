"""How the vLLM connector takes hold of a hand-off before it reports tokens to vLLM, without vLLM (so the main test
suite checks it): a NIXL hand-off record is validated from its manifest (`validate_record`), a file export is pinned
(`Pin`) and then validated (`choose_pinned`).

Notable:
- A NIXL record (`kv_transfer_params[nixl_transport.PARAMS_KEY]`, from the prefill's `KVPool.publish`) carries the
  export's manifest: the scheduler checks it as `vllm_plan.validate` checks a file export's (model, weights digest,
  cache_salt, prompt length and token hash, first token, dtype), plus the record's own layout (every model layer,
  its kind, KV heads, head_dim, dtype). The bytes are checked by the worker as they arrive (XXH3-128 per layer).
- Pinning closes the release race: the prefill may remove an export (`/v1/kv/release`, retention) at any time, and
  vLLM may find that export by token hash just before. The scheduler opens the manifest and every file of the
  resolved (immutable) export *before* validating it and validates the open files, through a private directory of
  links to `/proc/<pid>/fd/<n>`; the worker (this process or another of the same user) reads through those links.
  A removal after that unlinks names only: the load reads the bytes that were validated. A removal before it makes
  the pin fail, and vLLM prefills the request itself (never an error). The pin is closed when the request finishes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

from slope_jax.kv import compat
from slope_jax.kv import format as kvfmt
from slope_jax.kv import nixl_transport as nt
from slope_jax.kv import vllm_plan as plan

TRANSPORT_KEY = "slope_jax_transport"  # in a finished request's kv_transfer_params: how its KV arrived
NIXL, FILE = "nixl", "file"


@dataclasses.dataclass(frozen=True)
class NixlExport(plan.Validated):
    """A validated NIXL hand-off: `path` names the pool entry ("nixl:<agent>/<entry>", for messages), `record` is
    the hand-off record (`KVReader.pull` takes it), `checksums` is empty (the record's per-layer digests stand in)."""

    record: dict | None = None


def validate_record(params: dict, prompt: np.ndarray, cfg, cache_dtype: str, *, weights: str | None,
                    weights_unknown: str = "", cache_salt: str | None = None, lora: str | None = None,
                    check_fingerprint: bool = True, **_unused) -> NixlExport:
    """Check that the NIXL record in `params` is this prompt's KV for this model (what `vllm_plan.validate` checks of
    a file export, from the record's manifest; no byte is read). Raises ExportRefused naming the field."""
    rec = nt.params_of(params)
    try:
        nt.check_record(rec)
    except nt.KVTransferError as e:
        raise plan.ExportRefused(e.cause) from None
    parts = nt.parts_of(rec)  # validated by check_record
    more = len(parts) - 1
    where = f"nixl:{parts[0]['agent']}/{parts[0]['entry']}" + (f" (+{more} pool{'s' * (more > 1)})" if more else "")
    m = rec.get("manifest")
    if not isinstance(m, dict) or m.get("format") != kvfmt.FORMAT:
        raise plan.ExportRefused(f"{where}: manifest: missing or not a {kvfmt.FORMAT} manifest")
    try:
        compat.check_model(m, cfg, where, check_fingerprint=check_fingerprint)
    except kvfmt.KVFormatError as e:
        raise plan.ExportRefused(str(e)) from None
    plan.check_identity(where, m, cfg, weights, cache_salt, weights_unknown=weights_unknown, lora=lora)
    n, want_hash = len(prompt), kvfmt.token_hash(prompt)
    if m.get("num_tokens") != n:
        raise plan.ExportRefused(f"{where}: num_tokens: the export holds {m.get('num_tokens')} tokens, the prompt has "
                                 f"{n}")
    if m.get("token_ids_sha256") != want_hash:
        raise plan.ExportRefused(f"{where}: token_ids_sha256: {m.get('token_ids_sha256')} in the export, {want_hash} "
                                 "for the prompt (another prompt's KV)")
    first = params.get(plan.FIRST_TOKEN_KEY)
    if first is not None and m.get("first_token") is not None and first != m["first_token"]:
        raise plan.ExportRefused(f"kv_transfer_params.{plan.FIRST_TOKEN_KEY}={first!r}, the export's first_token is "
                                 f"{m['first_token']!r}")
    _check_layout(where, rec, m, cfg, cache_dtype)
    sliding_from = kvfmt.kept_range(n, kvfmt.SLIDING, cfg.sliding_window, m.get("sliding_policy") == "full")[0]
    return NixlExport(where, str(m.get("run_nonce")), {}, n, m["dtype"], sliding_from, rec)


def _check_layout(where: str, rec: dict, m: dict, cfg, cache_dtype: str) -> None:
    """The record's layers against the manifest and the model; its dtype against vLLM's cache."""
    if rec["dtype"] != m.get("dtype"):
        raise plan.ExportRefused(f"{where}: dtype: the record's tensors are {rec['dtype']}, the manifest says "
                                 f"{m.get('dtype')}")
    if (rec["dtype"], cache_dtype) not in plan._EXACT_CASTS:
        raise plan.ExportRefused(f"{where}: dtype: the export is {rec['dtype']}, vLLM's KV cache is {cache_dtype}: "
                                 "only exact (equal or widening) conversions are done")
    regions = {}  # global layer id → its regions (one; a composed record's pieces: the parts checked the tiling)
    composed = nt.is_composed(rec)
    for part in nt.parts_of(rec):
        pieces = part["manifest"]["pieces"] if composed else None
        for j, lay in enumerate(part["layers"]):
            regions.setdefault(int(pieces[j][0] if pieces else lay["layer"]), []).append(lay)
    for i, kind in enumerate(cfg.layer_types):
        for lay in regions.get(i) or [None]:
            if lay is None or lay["kind"] != kind:
                raise plan.ExportRefused(f"{where}: layers: layer {i} is {lay and lay['kind']} in the record, {kind} "
                                         "in the model")
            if (int(lay["kv_heads"]), int(lay["head_dim"])) != (cfg.num_key_value_heads, cfg.head_dim):
                raise plan.ExportRefused(f"{where}: layers[{i}]: {lay['kv_heads']} KV heads of {lay['head_dim']} in "
                                         f"the record, the model has {cfg.num_key_value_heads} of {cfg.head_dim}")


class Pin:
    """An export's manifest and files held open by this process (module doc), seen through `dir`
    (`<private temp dir>/<export id>`: links to `/proc/<pid>/fd/<n>`). `source` is the resolved export directory.
    Raises ExportRefused if the export is gone or incomplete (removed before or while it was pinned)."""

    def __init__(self, path: str):
        self._fds: list[int] = []
        self._root = None
        try:
            self.source = kvfmt.resolve(path)
            self._root = tempfile.mkdtemp(prefix="slope_jax_pin_")
            self.dir = os.path.join(self._root, kvfmt.export_id(self.source))
            os.mkdir(self.dir)
            self._link(kvfmt.MANIFEST)
            with open(os.path.join(self.dir, kvfmt.MANIFEST)) as f:
                files = json.load(f).get("files")
            if not isinstance(files, list):
                raise ValueError("the manifest lists no files")
            for name in files:
                if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                    raise ValueError(f"files: {name!r} is not a file name")
                try:
                    self._link(name)
                except FileNotFoundError:
                    pass  # not linked: validation refuses the export naming the missing file
        except (OSError, ValueError, kvfmt.KVFormatError) as e:
            self.close()
            raise plan.ExportRefused(f"{path}: cannot open the export ({type(e).__name__}: {e}): removed before it "
                                     "was validated?") from None

    def _link(self, name: str) -> None:
        fd = os.open(os.path.join(self.source, name), os.O_RDONLY | os.O_CLOEXEC)
        self._fds.append(fd)
        os.symlink(f"/proc/{os.getpid()}/fd/{fd}", os.path.join(self.dir, name))

    def close(self) -> None:
        """Close the files and remove the links (idempotent)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def pinning_works() -> bool:
    """Whether this system has /proc/self/fd (Linux): otherwise exports are validated unpinned."""
    return os.path.isdir(f"/proc/{os.getpid()}/fd")


def choose_pinned(params: dict | None, prompt: np.ndarray, index, **validate_kwargs
                  ) -> tuple[plan.Validated | None, str, Pin | None]:
    """`vllm_plan.choose`, each candidate pinned (`Pin`) before it is validated: (export whose `path` is the pin's
    directory, how it was found, the pin — the caller closes it when the request finishes), or (None, why none was
    found, None). Raises ExportRefused with every candidate's reason if all were refused."""
    if not pinning_works():
        export, how = plan.choose(params, prompt, index, **validate_kwargs)
        return export, how, None
    h = kvfmt.token_hash(prompt)
    refused: list[str] = []
    tried: set[str] = set()
    found = ""
    while True:
        paths, found = plan.find_paths(params, h, index, frozenset(tried))
        if not paths:
            break
        for path in paths:
            tried.add(path)
            try:
                pin = Pin(path)
            except plan.ExportRefused as e:
                refused.append(str(e))
                continue
            try:
                return plan.validate(pin.dir, prompt, params=params, **validate_kwargs), found, pin
            except plan.ExportRefused as e:
                pin.close()
                refused.append(str(e).replace(pin.dir, pin.source))  # name the export, not its pin
    if refused:
        raise plan.ExportRefused(refused[0] if len(refused) == 1 else
                                 f"{len(refused)} exports of this prompt, none usable: " + "; ".join(refused))
    return None, found, None
