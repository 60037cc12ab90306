"""Read a compiled XLA module's text (`compiled.as_text()`): how often each computation runs, its collectives and its
matmul FLOPs, with loop trip counts applied (no JAX needed).

XLA's own `cost_analysis()` counts a loop body once; here every computation is weighted by the product of
the `known_trip_count`s of the `while` loops around it. Loops whose trip count is data-dependent (the attention
key-tile range, MoE tiles per expert) are reported separately with their per-iteration FLOPs, keyed by the
`op_name` scope of the loop, so that a caller can apply a trip count it knows.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from slope_jax.model.options import MASKED_RUN_SCOPE, WHOLE_RUN_SCOPE

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "s8": 1, "u8": 1,
                "pred": 1, "s16": 2, "u16": 2}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_COMP_START = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")


def shape_bytes(text: str) -> list[int]:
    """Bytes of every array shape written in `text` (e.g. an instruction's result type)."""
    out = []
    for dt, dims in _SHAPE.findall(text):
        if dt in _DTYPE_BYTES:
            out.append(_DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d))
    return out


@dataclasses.dataclass
class Module:
    """Parsed module: computation name -> instruction lines, the entry, and each computation's execution count."""

    comps: dict[str, list[str]]
    entry: str
    mult: dict[str, float]  # executions per step (known trip counts applied); 0 if not reached
    dynamic: dict[str, str]  # computation -> op_name of the innermost enclosing loop with an unknown trip count
    shapes: dict[str, str]  # instruction name -> result type text


def parse(hlo_text: str) -> Module:
    """Split the module into computations and weight each by its callers' trip counts.

    Raises ValueError if there is no ENTRY computation.
    """
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMP_START.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    shapes: dict[str, str] = {}
    edges: dict[str, list[tuple[str, int | None, str]]] = collections.defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if m:
                shapes[m.group(2)] = m.group(3)
            if " while(" in line:
                body = re.search(r"body=%([^,\s]+)", line).group(1)
                trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
                op = re.search(r'op_name="([^"]*)"', line)
                edges[name].append((body, int(trip.group(1)) if trip else None, op.group(1) if op else ""))
            for key in ("calls", "to_apply", "true_computation", "false_computation"):
                for callee in re.findall(key + r"=%([^,\s}]+)", line):
                    edges[name].append((callee, 1, ""))
            for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
                for callee in re.findall(r"%([^,\s]+)", group):
                    edges[name].append((callee, 1, ""))

    mult: dict[str, float] = collections.defaultdict(float)
    dynamic: dict[str, str] = {}

    def visit(name: str, factor: float, loop: str | None):
        mult[name] += factor
        if loop is not None:
            dynamic[name] = loop
        for callee, f, op in edges.get(name, ()):
            visit(callee, factor * (1 if f is None else f), op if f is None else loop)

    visit(entry, 1, None)
    return Module(comps, entry, dict(mult), dynamic, shapes)


def _dims(type_text: str) -> list[int]:
    m = _SHAPE.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def dot_flops(line: str, shapes: dict[str, str]) -> float:
    """FLOPs of one `dot` instruction: 2 × (output elements) × (contracted size of the left operand)."""
    m = _INSTR.match(line)
    out = math.prod(_dims(m.group(3)))
    lhs = re.match(r"\s*%([^,\s)]+)", m.group(5)).group(1)
    lhs_dims = _dims(shapes[lhs])
    contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
    k = math.prod(lhs_dims[int(i)] for i in contract.group(1).split(",") if i) if contract else 1
    return 2.0 * out * k


def matmul_flops(hlo_text: str) -> dict:
    """Dot FLOPs per device for one execution of the module.

    Returns `{"static": FLOPs of dots whose executions are all known, "dynamic": {loop op_name: FLOPs of one pass of
    that loop's body (outer known trip counts applied)}}`; a caller multiplies each dynamic entry by its trip count.
    The attention core splits each query tile's key tiles into runs (masked, whole, masked: `model.attention`'s
    run scopes) whose bodies run the same dots: one pass is the whole run's, keyed without its scope.
    """
    mod = parse(hlo_text)
    static = 0.0
    dynamic: dict[str, float] = collections.defaultdict(float)
    for name, lines in mod.comps.items():
        n = mod.mult.get(name, 0)
        if not n:
            continue
        for line in lines:
            mi = _INSTR.match(line)
            if not mi or mi.group(4) not in ("dot", "convolution"):
                continue
            f = dot_flops(line, mod.shapes) * n
            if name in mod.dynamic:
                op = mod.dynamic[name]
                if f"/{MASKED_RUN_SCOPE}/" in op:
                    continue
                dynamic[op.replace(f"/{WHOLE_RUN_SCOPE}/", "/")] += f
            else:
                static += f
    return {"static": static, "dynamic": dict(dynamic)}


def _strip_ones(dims: list[int]) -> tuple[int, ...]:
    i = 0
    while i < len(dims) and dims[i] == 1:
        i += 1
    return tuple(dims[i:])


def widened_copies(hlo_text: str, *, min_elements: int = 4096) -> list[str]:
    """Instructions that re-write a bf16 input or output of the step, whole or a leading-axis slice of it, as float32.

    The fault class `slope_jax.model.stack` describes: XLA:CPU runs a dynamic slice, update or gather of bf16 through
    float32 and hoists the convert of the whole operand out of the loop around it, so slicing a layer (or a request,
    or a cached prefix) out of a bf16 stack inside a loop re-writes the whole stack as float32 on every step. Compile
    the step with native bf16 matmuls (`StepOptions(bf16_matmul="native")`: widened operands are float32 by design)
    and expect [].

    Args:
      hlo_text: a compiled module's text (`compiled.as_text()`).
      min_elements: smaller arrays are ignored (scalars and short vectors coincide with shapes by chance).
    Returns:
      One line per offending materialised instruction (outside fusion bodies; views, tuples and loops are not
      counted, the instruction that fills them is): `"<name> = f32[dims] (<bf16 array>)"`; [] if none. A float32
      result counts when its dims, leading 1s dropped, equal the trailing dims of a bf16 (or uint16: bf16 bits,
      `stack.bits`) entry parameter or root element — the whole array or its slice at leading indices.
    """
    mod = parse(hlo_text)
    sources: dict[tuple[int, ...], str] = {}
    for line in mod.comps[mod.entry]:
        m = _INSTR.match(line)
        if m and (m.group(4) == "parameter" or m.group(1)):
            for dt, dims in _SHAPE.findall(m.group(3)):
                full = _strip_ones([int(x) for x in dims.split(",") if x])
                if dt in ("bf16", "u16"):
                    for j in range(len(full)):
                        if math.prod(full[j:]) >= min_elements:
                            sources.setdefault(full[j:], f"{dt}[{','.join(map(str, full))}]")
    fused = {c for lines in mod.comps.values() for line in lines if " fusion(" in line
             for c in re.findall(r"calls=%([^,\s}]+)", line)}
    views = ("parameter", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional")
    out = []
    for name, lines in mod.comps.items():
        if not mod.mult.get(name) or name in fused:  # inside a fusion nothing is materialised
            continue
        for line in lines:
            m = _INSTR.match(line)
            if not m or m.group(4) in views:
                continue
            sm = _SHAPE.match(m.group(3))
            if sm and sm.group(1) == "f32":
                dims = _strip_ones([int(x) for x in sm.group(2).split(",") if x])
                if dims in sources:
                    out.append(f"{m.group(2)} = f32[{','.join(map(str, dims))}] ({sources[dims]})")
    return out
