"""Prefill requests: one JSON object per line, validated at the boundary.

    {"id": "doc-17", "tokens": [1015, 44, 310, ...], "ttft_slo_ms": 1000}
    {"id": "chat-3", "text": "It was the best of times"}          # needs tokenizer.json in the checkpoint
    {"id": "raw-1", "text": "literal <|endoftext|> text", "text_literal": true}

Fields: `id` (1-128 characters of [A-Za-z0-9._-], not starting with '.': it names the request's KV directory;
unique within a run), exactly one of `tokens` (non-empty list of ints in [0, vocab)) or `text` (non-empty string),
optional `text_literal` (bool, with `text`: special-token strings such as "<|endoftext|>" are encoded as ordinary
text instead of as the control token), optional `ttft_slo_ms` (finite number > 0), optional `cache_salt` (a
non-empty string of at most 1024 characters, vLLM's field: prompts share cached prefixes only with prompts of the
same salt; one per tenant). Anything else is an error.

The boundary is total: whatever goes wrong while decoding (the line must be UTF-8), parsing (strict JSON: NaN,
Infinity and numbers that overflow a float are refused), validating or tokenizing one line raises `LineError` for that
line only; the caller turns it into an error record (`error_record`) and serves every other line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np


class RequestError(ValueError):
    """A prompt is invalid (empty, a token id out of range, too long); the message names the prompt and the limit."""


class LineError(RequestError):
    """One request line is bad. `line`: its 1-based number; `request_id`: its id when the id itself was valid and not
    taken; `duplicate_of`: the id when the line reuses an id already seen."""

    def __init__(self, message: str, line: int, request_id: str | None = None, duplicate_of: str | None = None):
        super().__init__(message)
        self.line, self.request_id, self.duplicate_of = line, request_id, duplicate_of


class ClientLeft:
    """What a request source hands the loop, in place of a request line, for a request whose client disconnected
    before the prefill took it (`serve.http.HttpIntake.get`): the loop writes its `cancelled_record` and computes
    nothing. `request_id`: the request's id."""

    def __init__(self, request_id: str):
        self.request_id = request_id


def cancelled_record(request_id: str, line: int, num_tokens: int | None = None) -> dict:
    """The result line of a request whose client disconnected before its prefill started: `"cancelled": true`, not
    computed, not counted as failed nor in SLO attainment (`serve.summary`, `scheduler.slo_stats`)."""
    rec = {"id": request_id, "line": line, "cancelled": True,
           "error": f"line {line} ({request_id}): the client disconnected before the prefill started; not computed"}
    if num_tokens is not None:
        rec["num_tokens"] = int(num_tokens)
    return rec


def error_record(err: LineError) -> dict:
    """The result line for a bad request line. Its `id` is the request's id only when that id is valid and was not used
    before; a duplicate gets `"id": null` plus `"duplicate_of"`, so each id names at most one record. `line` is always
    given (1-based line number of the input)."""
    rec = {"id": err.request_id, "line": err.line, "error": str(err)}
    if err.duplicate_of is not None:
        rec["duplicate_of"] = err.duplicate_of
    return rec


_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_request_id(request_id: str, where: str = "request") -> str:
    """A request id doubles as a directory name under the KV dir: 1-128 characters of [A-Za-z0-9._-], not starting
    with '.', so it can never escape that directory. Raises RequestError naming the rule."""
    if not isinstance(request_id, str) or not 1 <= len(request_id) <= 128:
        got = (f"{len(request_id)} characters" if isinstance(request_id, str) else
               f"{type(request_id).__name__} {_short(request_id)}")
        raise RequestError(f"{where}: id must be a string of 1-128 characters, got {got}")
    if request_id.startswith(".") or not set(request_id) <= _ID_CHARS:
        raise RequestError(f"{where}: id {_short(request_id)} may only use letters, digits, '.', '_', '-' and must "
                           "not start with '.' (it names the request's KV directory)")
    return request_id


_FIELDS = {"id", "tokens", "text", "text_literal", "ttft_slo_ms", "cache_salt"}
MAX_SALT = 1024


@dataclasses.dataclass
class Request:
    id: str
    tokens: np.ndarray  # int32 [n]
    ttft_slo_ms: float | None
    arrival: float  # time.perf_counter() when the line arrived
    line: int
    cache_salt: str | None = None


def _short(value, limit: int = 60) -> str:
    """repr() cut to `limit` characters, safe for any value (lone surrogates are escaped by repr)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed (strict JSON: numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a float64")
    return value


def loads_strict(text: str):
    """`json.loads` that refuses NaN/Infinity literals and numbers that overflow a float64 (ValueError)."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def parse(line: bytes | str, lineno: int, *, vocab_size: int, max_tokens: int, tokenizer=None,
          seen_ids: set[str] | None = None, arrival: float | None = None, label: str = "line") -> Request:
    """Validate one request line (raw bytes as read, or text). Raises LineError naming the line, the field and the
    rule; never any other exception. `seen_ids` (updated) makes ids unique; `arrival`: perf_counter() stamp of the
    line's arrival (default: now); `label`: what messages call the item ("line 3 (id): ..."; the HTTP endpoint says
    "request")."""
    arrival = time.perf_counter() if arrival is None else arrival
    state = {"id": None, "dup": None}
    try:
        return _parse(line, f"{label} {lineno}", lineno, vocab_size, max_tokens, tokenizer, seen_ids, arrival, state)
    except LineError:
        raise
    except RequestError as e:
        raise LineError(str(e), lineno, state["id"], state["dup"]) from e
    except Exception as e:  # noqa: BLE001 - the boundary is total: any failure is this line's error, never the run's
        where = f"{label} {lineno}" + (f" ({state['id']})" if state["id"] else "")
        raise LineError(f"{where}: could not process the request ({type(e).__name__}: {str(e)[:200]})", lineno,
                        state["id"], state["dup"]) from e


def _text(line: bytes | bytearray | str, where: str) -> str:
    """A line's JSON text: UTF-8 decoded, without a byte order mark before it (a file saved as "UTF-8 with BOM", or
    such files concatenated: RFC 8259 §8.1 lets a parser ignore it)."""
    if isinstance(line, (bytes, bytearray)):
        try:
            line = bytes(line).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{where}: not valid UTF-8 (byte 0x{line[e.start]:02x} at offset {e.start})") from e
    return line.removeprefix("\ufeff")


def _parse(line, where, lineno, vocab_size, max_tokens, tokenizer, seen_ids, arrival, state) -> Request:
    line = _text(line, where)
    try:
        obj = loads_strict(line)
    except json.JSONDecodeError as e:
        # json's messages for some rules end in "at" ("Invalid control character at"): no second "at"
        at = "" if e.msg.endswith(" at") else " at"
        # a line is one JSON text: a position past its last character (e.g. a missing "}") is its end, which
        # json counts as column 1 of the next line when the line keeps its newline
        spot = "the end of the line" if e.pos >= len(line.rstrip()) else f"column {e.pos + 1}"
        raise RequestError(f"{where}: not valid JSON ({e.msg}{at} {spot})") from e
    except (ValueError, RecursionError) as e:
        raise RequestError(f"{where}: not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise RequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        raise RequestError(f"{where}: missing field 'id'")
    rid = check_request_id(obj["id"], where)
    if seen_ids is not None:
        if rid in seen_ids:
            state["dup"] = rid
            raise RequestError(f"{where}: duplicate id {rid!r} (ids name KV directories and must be unique; the "
                               "first request with this id keeps it)")
        seen_ids.add(rid)
    state["id"] = rid
    where = f"{where} ({rid})"
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise RequestError(f"{where}: unknown field(s) {_short(unknown, 120)}; allowed: {sorted(_FIELDS)}")
    if ("tokens" in obj) == ("text" in obj):
        raise RequestError(f"{where}: give exactly one of 'tokens' or 'text'")
    literal = obj.get("text_literal", False)
    if not isinstance(literal, bool):
        raise RequestError(f"{where}: 'text_literal' must be true or false, got {_short(literal)}")
    if "text_literal" in obj and "text" not in obj:
        raise RequestError(f"{where}: 'text_literal' applies to 'text' only")
    slo = obj.get("ttft_slo_ms")
    if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or not 0 < slo < math.inf):
        raise RequestError(f"{where}: 'ttft_slo_ms' must be a finite number > 0, got {_short(slo)}")
    salt = _salt(obj.get("cache_salt"), where)
    if "text" in obj:
        ids = _encode(obj["text"], literal, tokenizer, where)
    else:
        ids = obj["tokens"]
        if not isinstance(ids, list):
            raise RequestError(f"{where}: 'tokens' must be a list of integers, got {type(ids).__name__}")
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise RequestError(f"{where}: 'tokens'[{i}] is {_short(t)} ({type(t).__name__}); token ids must be "
                                   "integers")
    if not ids:
        raise RequestError(f"{where}: the prompt is empty")
    if len(ids) > max_tokens:
        raise RequestError(f"{where}: {len(ids)} tokens exceeds the limit of {max_tokens} (--max_tokens)")
    for i, t in enumerate(ids):  # in Python ints: a value beyond int64 is out of range, not an overflow
        if not 0 <= t < vocab_size:
            raise RequestError(f"{where}: token id {_short(t, 40)} at index {i} is outside the vocabulary "
                               f"[0, {vocab_size})")
    return Request(rid, np.asarray(ids, dtype=np.int32), None if slo is None else float(slo), arrival, lineno, salt)


def _salt(salt, where: str) -> str | None:
    """The optional `cache_salt`: None, or a non-empty string of at most MAX_SALT characters (RequestError)."""
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_SALT):
        raise RequestError(f"{where}: 'cache_salt' must be a non-empty string of at most {MAX_SALT} characters, got "
                           f"{_short(salt)}")
    return salt


def _encode(text, literal: bool, tokenizer, where: str) -> list[int]:
    if not isinstance(text, str) or not text:
        raise RequestError(f"{where}: 'text' must be a non-empty string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{where}: 'text' is not valid Unicode (lone surrogate U+{ord(text[e.start]):04X} at "
                           f"index {e.start})") from e
    if tokenizer is None:
        raise RequestError(f"{where}: 'text' needs a tokenizer, and the checkpoint has no tokenizer.json; send "
                           "'tokens' instead")
    previous = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = literal  # True: "<|endoftext|>" is split as ordinary text
    try:
        return list(tokenizer.encode(text).ids)
    except Exception as e:  # noqa: BLE001 - a tokenizer failure is this request's error
        raise RequestError(f"{where}: the tokenizer failed on 'text' ({type(e).__name__}: {str(e)[:200]})") from e
    finally:
        tokenizer.encode_special_tokens = previous
