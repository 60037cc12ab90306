"""Prefill requests: one JSON object per line, validated at the boundary.

    {"id": "doc-17", "tokens": [1015, 44, 310, ...], "ttft_slo_ms": 1000}
    {"id": "chat-3", "text": "It was the best of times"}          # needs tokenizer.json in the checkpoint

Fields: `id` (1-128 characters of [A-Za-z0-9._-], not starting with '.': it names the request's KV directory;
unique within a run), exactly one of `tokens` (non-empty list of ints in [0, vocab)) or `text` (non-empty string),
optional `ttft_slo_ms` (> 0). Anything else is an error. A bad line becomes an error record and the run goes on.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np


class RequestError(ValueError):
    """A prompt is invalid (empty, a token id out of range, too long); the message names the prompt and the limit."""


_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_request_id(request_id: str, where: str = "request") -> str:
    """A request id doubles as a directory name under the KV dir: 1-128 characters of [A-Za-z0-9._-], not starting
    with '.', so it can never escape that directory. Raises RequestError naming the rule."""
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= 128:
        raise RequestError(f"{where}: id must be a string of 1-128 characters, got {request_id!r}")
    if request_id.startswith(".") or not set(request_id) <= _ID_CHARS:
        raise RequestError(f"{where}: id {request_id!r} may only use letters, digits, '.', '_', '-' and must not "
                           "start with '.' (it names the request's KV directory)")
    return request_id


_FIELDS = {"id", "tokens", "text", "ttft_slo_ms"}


@dataclasses.dataclass
class Request:
    id: str
    tokens: np.ndarray  # int32 [n]
    ttft_slo_ms: float | None
    arrival: float  # time.perf_counter() when the line was read
    line: int


def parse(line: str, lineno: int, *, vocab_size: int, max_tokens: int, tokenizer=None,
          seen_ids: set[str] | None = None) -> Request:
    """Validate one request line. Raises RequestError with the line number, the field and the rule."""
    arrival = time.perf_counter()
    where = f"line {lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise RequestError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(obj, dict):
        raise RequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise RequestError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(_FIELDS)}")
    if "id" not in obj:
        raise RequestError(f"{where}: missing field 'id'")
    rid = check_request_id(obj["id"], where)
    if seen_ids is not None:
        if rid in seen_ids:
            raise RequestError(f"{where}: duplicate id {rid!r} (ids name KV directories and must be unique)")
        seen_ids.add(rid)
    if ("tokens" in obj) == ("text" in obj):
        raise RequestError(f"{where} ({rid}): give exactly one of 'tokens' or 'text'")
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str) or not text:
            raise RequestError(f"{where} ({rid}): 'text' must be a non-empty string")
        if tokenizer is None:
            raise RequestError(f"{where} ({rid}): 'text' needs a tokenizer, and the checkpoint has no tokenizer.json; "
                               "send 'tokens' instead")
        ids = tokenizer.encode(text).ids
    else:
        ids = obj["tokens"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError(f"{where} ({rid}): 'tokens' must be a list of integers")
    if not ids:
        raise RequestError(f"{where} ({rid}): the prompt is empty")
    arr = np.asarray(ids, dtype=np.int64)
    bad = np.nonzero((arr < 0) | (arr >= vocab_size))[0]
    if bad.size:
        raise RequestError(f"{where} ({rid}): token id {int(arr[bad[0]])} at index {int(bad[0])} is outside the "
                           f"vocabulary [0, {vocab_size})")
    if arr.size > max_tokens:
        raise RequestError(f"{where} ({rid}): {arr.size} tokens exceeds the limit of {max_tokens} (--max_tokens)")
    slo = obj.get("ttft_slo_ms")
    if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or not slo > 0):
        raise RequestError(f"{where} ({rid}): 'ttft_slo_ms' must be a positive number, got {slo!r}")
    return Request(rid, arr.astype(np.int32), None if slo is None else float(slo), arrival, lineno)
