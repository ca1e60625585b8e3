"""Reading compiled HLO text: the collectives a program runs (kind, element type, shape, bytes), and converts.

Used by `jaxserve plan` and by the tests that assert a sharded program moves only what it should.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# `%name = f32[8,64]{1,0} all-reduce(...)` and the async `-start` forms
_OP = re.compile(r"= ([a-z0-9]+)\[([0-9,]*)\](?:\{[^}]*\})? (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
# tuple-shaped results: combined collectives (XLA:GPU merges small ones), `= (f32[8], s32[8]) all-reduce(` (every
# member a result), and async starts, `= (bf16[8,7168], bf16[64,7168]) all-gather-start(` (operand, result, ...) or
# `= ((u32[1025], u8[8,576]), (u32[8200], u8[64,576])) all-gather-start(` (operands, then results), or
# `= ((f32[64,7168]), f32[8,7168]) reduce-scatter-start(`
_TUPLE_OP = re.compile(r"= \(((?:[^()=\n]|\([^()=\n]*\))*)\) (" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_CONVERT = re.compile(r"= ([a-z0-9]+)\[([0-9,]*)\](?:\{[^}]*\})? convert\(([a-z0-9]+)\[([0-9,]*)\]")


@dataclass(frozen=True)
class Collective:
    kind: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.elements * _BYTES.get(self.dtype, 4)


def _top_level(inner: str) -> list[str]:
    """The members of a tuple type's text (without its outer parentheses), nested tuples, dims and layouts whole."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append(inner[start:i].strip())
            start = i + 1
    return [*out, inner[start:].strip()]


def _shape(dims: str) -> tuple[int, ...]:
    return tuple(int(d) for d in dims.split(",") if d)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op in a compiled module's text, with its result type (a combined op: one per result)."""
    ops = [Collective(m.group(3), m.group(1), _shape(m.group(2))) for m in _OP.finditer(hlo_text)]
    for m in _TUPLE_OP.finditer(hlo_text):
        inner, kind, start = m.groups()
        members = _top_level(inner)
        if any(x.startswith("(") for x in members) or (start and kind != "all-reduce"):
            results = _ARRAY.findall(members[1] if len(members) > 1 else members[-1])  # (operands, results, ...)
        else:  # a combined op or all-reduce-start: every member a result
            results = _ARRAY.findall(inner)
        ops += [Collective(kind, dt, _shape(dims)) for dt, dims in results]
    return ops


def summarize(ops: list[Collective]) -> list[dict[str, object]]:
    """[{kind, dtype, shape, count, bytes (each)}] grouped, largest first."""
    counts = Counter(ops)
    rows = [{"kind": c.kind, "dtype": c.dtype, "shape": list(c.shape), "count": n, "bytes": c.bytes}
            for c, n in counts.items()]
    return sorted(rows, key=lambda r: -int(r["bytes"]) * int(r["count"]))


def converts(hlo_text: str) -> list[tuple[str, tuple[int, ...], str, tuple[int, ...]]]:
    """(to dtype, to shape, from dtype, from shape) of every convert whose operand type is printed inline."""
    return [(m.group(1), _shape(m.group(2)), m.group(3), _shape(m.group(4))) for m in _CONVERT.finditer(hlo_text)]
