"""Malformed request lines (raw bytes) for the request-boundary tests: every kind of failure while reading, decoding,
parsing, tokenizing or validating a line. Each must become exactly one error record; `MAX_TOKENS` is the
--max_tokens the launcher tests use (the last lines exceed it)."""

import json

MAX_TOKENS = 100


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


MALFORMED: list[bytes] = [
    b'{"id": "f-int64", "tokens": [1, 2, 18446744073709551616]}',          # beyond int64
    b'{"id": "f-neg-big", "tokens": [-99999999999999999999999]}',
    b'{"id": "f-surrogate", "text": "x \\ud800 y"}',                       # lone surrogate
    b'{"id": "f-surrogate2", "text": "\\udfff"}',
    b'\xff\xfe{"id": "f-latin1"}',                                         # not UTF-8
    b'{"id": "f-bad-utf8", "text": "caf\xe9"}',
    b'\xc3\x28',
    b'{"id": "f-float", "tokens": [1, 2.5]}',                              # wrong token types
    b'{"id": "f-float-int", "tokens": [1.0]}',
    b'{"id": "f-bool", "tokens": [true, false]}',
    b'{"id": "f-nested", "tokens": [[1, 2], [3]]}',
    b'{"id": "f-str-tok", "tokens": ["1", "2"]}',
    b'{"id": "f-null-tok", "tokens": [null]}',
    b'{"id": "f-tokens-str", "tokens": "1 2 3"}',
    b'{"id": "f-tokens-obj", "tokens": {"0": 1}}',
    b'{"id": "f-empty", "tokens": []}',
    b'{"id": "f-oov", "tokens": [1, 1024]}',
    b'{"id": "f-negative", "tokens": [-1]}',
    b'{"id": "f-slo-huge", "tokens": [1], "ttft_slo_ms": 1e400}',          # overflows a float
    b'{"id": "f-slo-nan", "tokens": [1], "ttft_slo_ms": NaN}',             # NaN / Infinity literals
    b'{"id": "f-slo-inf", "tokens": [1], "ttft_slo_ms": Infinity}',
    b'{"id": "f-slo-neginf", "tokens": [1], "ttft_slo_ms": -Infinity}',
    b'{"id": "f-slo-zero", "tokens": [1], "ttft_slo_ms": 0}',
    b'{"id": "f-slo-str", "tokens": [1], "ttft_slo_ms": "100"}',
    b'{"id": "f-slo-bool", "tokens": [1], "ttft_slo_ms": true}',
    b'NaN',
    b'[1, 2, 3]',                                                          # not an object
    b'"just a string"',
    b'42',
    b'null',
    b'{"id": "f-trunc", "tokens": [1, 2',                                  # not JSON
    b'{id: "f-unquoted"}',
    b'{"tokens": [1, 2]}',                                                 # id problems
    b'{"id": 17, "tokens": [1]}',
    b'{"id": null, "tokens": [1]}',
    b'{"id": "../escape", "tokens": [1]}',
    b'{"id": ".hidden", "tokens": [1]}',
    b'{"id": "' + b"x" * 200 + b'", "tokens": [1]}',
    b'{"id": "f-both", "tokens": [1], "text": "hi"}',                      # field problems
    b'{"id": "f-neither"}',
    b'{"id": "f-unknown", "tokens": [1], "temperature": 0.7}',
    b'{"id": "f-text-num", "text": 5}',
    b'{"id": "f-text-empty", "text": ""}',
    b'{"id": "f-literal-str", "text": "hi", "text_literal": "yes"}',
    b'{"id": "f-literal-tokens", "tokens": [1], "text_literal": true}',
    b'[' * 100000 + b']' * 100000,                                         # nesting deeper than the parser allows
    _j({"id": "f-too-long", "tokens": [5] * (MAX_TOKENS + 1)}),            # too long for --max_tokens
    b'{"id": "dup-target", "tokens": [9, 8, 7]}',                          # a valid line ...
    b'{"id": "dup-target", "tokens": [1, 2]}',                             # ... and its duplicate
]
# (the 48th line, dup-target, is valid: one result; every other line is one error record)
VALID_IN_MALFORMED = {"dup-target"}
