"""The memory traffic of a compiled HLO module, read from its text: every instruction that runs (the entry
computation and the bodies of its while loops, conditionals and calls) with the bytes it reads and writes, sorted
into Pallas kernels, XLA matmuls, reads of weight parameters, collectives and everything else ("outside the kernels":
elementwise and reduce fusions, copies, converts, transposes, scatters, slices, sorts).

What moves nothing: parameters, constants, tuples, get-tuple-element, bitcasts, async `-done` halves. What moves
part of a buffer: an operand that a fusion only slices, dynamic-slices or gathers, directly or through views and
elementwise ops (the slices' bytes: a loop fusion computes those ops only where its output needs them); the buffer
a dynamic-update-slice or scatter updates in place (the update's bytes, not the buffer's). A Pallas custom call's bytes
are the nominal sizes of its operands and results: what it reads inside (live pages, routed experts) is not in the
text, so the roofline (jaxserve/roofline.py) counts kernels from the model instead. Used by plan_compile.py.

HBM only: an operand or result in another memory space (`S(1)`, XLA:TPU's VMEM, in its layout) moves no HBM bytes, so
a TPU weight is counted once, where XLA prefetches it from HBM: a `copy-start` reads its source, a `slice-start` its
slice (not the whole source); the `ConcatBitcast` joining the slices in VMEM and the ops reading them move nothing.
A prefetch of a weight is that weight's read (category "weights", as the minimum counts it), not "outside", unless a
Pallas kernel reads the prefetched buffer: the kernel's own read of its operand (routed experts: the touched ones, which
the minimum counts) moved out of it by XLA, whole, so "outside"; so is a prefetch of the whole embedding (the minimum
counts the batch's rows of it).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.hlo import _BYTES, COLLECTIVES

PALLAS_TARGETS = ("__gpu$xla.gpu.triton", "tpu_custom_call", "mosaic_gpu")  # Pallas Triton / Mosaic TPU / Mosaic GPU
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id",
                  "after-all", "add-dependency", "opt-barrier", "domain"})
CATEGORIES = ("kernel", "matmul", "weights", "collective", "outside")
_SLICING = frozenset({"slice", "dynamic-slice", "gather"})
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # op -> the operand holding the update
_VIEWS = frozenset({"bitcast", "reshape"})  # a view of its operand: follow it to see how the operand is read
_ELEMENTWISE = frozenset({"convert", "bitcast-convert", "negate", "abs", "exp", "log", "sqrt", "rsqrt", "tanh",
                          "logistic", "floor", "ceil", "round-nearest-even", "sign", "not", "add", "subtract",
                          "multiply", "divide", "maximum", "minimum", "select", "compare", "and", "or", "xor",
                          "clamp", "power", "copy"})
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s+\(")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s*=\s*")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_ARRAY_LAYOUT = re.compile(r"[a-z][a-z0-9]*\[[0-9,]*\](\{[^}]*\})?")
_SPACE = re.compile(r"(?<![A-Z])S\((\d+)\)")  # a layout's memory space: S(1) = XLA:TPU's VMEM; none = HBM
_OP = re.compile(r"\s*([a-z][a-z0-9_-]*)\(")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclass(frozen=True)
class Instr:
    """One HLO instruction: result arrays ((dtype, shape) per tuple element), op, operand names, the rest of the
    line (attributes), whether it is its computation's root."""

    name: str
    types: tuple[tuple[str, tuple[int, ...]], ...]
    op: str
    operands: tuple[str, ...]
    attrs: str
    root: bool = False
    args: str = ""  # the text between the op's parentheses (a parameter's index, a constant's value)
    spaces: tuple[int, ...] = ()  # memory space of each result array (0: HBM; S(1): VMEM); empty: all HBM

    @property
    def bytes(self) -> int:
        """Nominal bytes of its results, whatever their memory space."""
        return sum(array_bytes(t) for t in self.types)

    def in_hbm(self, i: int) -> bool:
        return i >= len(self.spaces) or self.spaces[i] == 0

    @property
    def hbm_bytes(self) -> int:
        """Bytes of its results that live in HBM (memory space 0)."""
        return sum(array_bytes(t) for i, t in enumerate(self.types) if self.in_hbm(i))

    def attr(self, key: str) -> str | None:
        m = re.search(key + r"=%([^\s,}]+)", self.attrs)
        return m.group(1) if m else None


@dataclass(frozen=True)
class Traffic:
    """One instruction's memory traffic: category "kernel" | "matmul" | "weights" | "collective" | "outside"; op:
    its HLO op (a fusion: "fusion:<kind>"); what: the op_name of its metadata (the JAX operation it came from);
    result: its result type; bytes: read + written (a collective: its result bytes, over the interconnect)."""

    category: str
    op: str
    what: str
    result: str
    bytes: int


def array_bytes(t: tuple[str, tuple[int, ...]]) -> int:
    d, s = t
    return 0 if d == "token" else math.prod(s) * _BYTES.get(d, 4)


def _matching(s: str, i: int) -> int:
    """Index just past the parenthesis that closes the one at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j + 1
    return len(s)


def _types(s: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) for m in _ARRAY.finditer(s))


def _spaces(s: str) -> tuple[int, ...]:
    """Memory space of each array in a type string, in `_types`' order (0 where the layout names none)."""
    return tuple(int(sp.group(1)) if m.group(1) and (sp := _SPACE.search(m.group(1))) else 0
                 for m in _ARRAY_LAYOUT.finditer(s))


def parse_instr(line: str) -> Instr | None:
    """One instruction line of HLO text (None: not an instruction)."""
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    end = _matching(rest, 0) if rest.startswith("(") else rest.find(" ")
    if end <= 0:
        return None
    op = _OP.match(rest, end)
    if not op:
        return None
    close = _matching(rest, op.end() - 1)
    args = rest[op.end():close - 1]
    operands = tuple(re.findall(r"%([^\s,)]+)", args))
    return Instr(m.group(2), _types(rest[:end]), op.group(1), operands, rest[close:], bool(m.group(1)), args,
                 _spaces(rest[:end]))


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
    """Computations (name -> instructions in order) of an HLO module's text, and the entry computation's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h and line.rstrip().endswith("{"):
            current = h.group(2)
            comps[current] = []
            entry = current if h.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            ins = parse_instr(line)
            if ins is not None:
                comps[current].append(ins)
    return comps, entry


def _users(instrs: list[Instr]) -> dict[str, list[tuple[Instr, int]]]:
    out: dict[str, list[tuple[Instr, int]]] = {}
    for ins in instrs:
        for pos, o in enumerate(ins.operands):
            out.setdefault(o, []).append((ins, pos))
    return out


def _elements(ins: Instr) -> int:
    return sum(math.prod(shape) for _, shape in ins.types)


def _accessed(ins: Instr, users: dict[str, list[tuple[Instr, int]]], depth: int = 0) -> float:
    """The fraction of `ins`'s elements a fusion reads: what its slices, dynamic-slices and gathers take (through
    views and elementwise ops, which a fusion computes only where its output needs them), nothing where it is only
    updated in place, else all."""
    if ins.root:  # the fusion's output: all of it is written, so all of it is computed
        return 1.0
    us = users.get(ins.name, [])
    n = max(_elements(ins), 1)
    total = 0.0
    for u, pos in us:
        if u.op in _SLICING and pos == 0:  # a slice of a slice (a layer, then its rows) reads the inner one
            total += _elements(u) / n * (_accessed(u, users, depth + 1) if depth < 16 else 1.0)
        elif u.op in _IN_PLACE and pos == 0:
            continue
        elif (u.op in _VIEWS or u.op in _ELEMENTWISE) and _elements(u) == n and depth < 16:
            total += _accessed(u, users, depth + 1)
        else:
            return 1.0
        if total >= 1.0:
            return 1.0
    return total


def _written(ins: Instr, by_name: dict[str, Instr]) -> int:
    """HBM bytes a fusion's root writes: an in-place update of a fused parameter writes the update only."""
    parts = [by_name[o] for o in ins.operands if o in by_name] if ins.op == "tuple" else [ins]
    total = 0
    for p in parts:
        base = p
        while base.op in _VIEWS and base.operands and base.operands[0] in by_name:
            base = by_name[base.operands[0]]
        if base.op in _IN_PLACE and _aliases_param(base, by_name):
            upd = by_name.get(base.operands[_IN_PLACE[base.op]])
            total += upd.bytes if upd is not None and base.in_hbm(0) else 0
        else:
            total += p.hbm_bytes
    return total


def _aliases_param(ins: Instr, by_name: dict[str, Instr]) -> bool:
    """Whether operand 0 of an in-place op is (a view of) a fusion parameter: the buffer is updated in place."""
    x = by_name.get(ins.operands[0])
    while x is not None and x.op in _VIEWS:
        x = by_name.get(x.operands[0]) if x.operands else None
    return x is not None and x.op == "parameter"


def fusion_io(ins: Instr, comps: dict[str, list[Instr]], operand_bytes: list[int]) -> tuple[list[int], int]:
    """(HBM bytes read of each operand, HBM bytes written) of a fusion instruction (see the module docstring);
    operand_bytes: each operand's HBM bytes."""
    body = comps.get(ins.attr("calls") or "", [])
    if not body:
        return list(operand_bytes), ins.hbm_bytes
    params = {int(p.args): p for p in body if p.op == "parameter" and p.args.strip().isdigit()}
    users = _users(body)
    reads = [round(b * _accessed(params[i], users)) if i in params else b for i, b in enumerate(operand_bytes)]
    by_name = {b.name: b for b in body}
    root = next((b for b in body if b.root), body[-1])
    return reads, _written(root, by_name) if ins.hbm_bytes else 0  # a result in VMEM writes no HBM


def _has_dot(name: str, comps: dict[str, list[Instr]], depth: int = 0) -> bool:
    """Whether a fused computation multiplies matrices (dot / convolution), nested fusions included."""
    for i in comps.get(name, []):
        if i.op in ("dot", "convolution"):
            return True
        if i.op == "fusion" and depth < 4 and _has_dot(i.attr("calls") or "", comps, depth + 1):
            return True
    return False


def _what(ins: Instr) -> str:
    m = re.search(r'op_name="([^"]*)"', ins.attrs)
    return "/".join(m.group(1).split("/")[-2:]) if m else ""


def _type_str(ins: Instr) -> str:
    return ", ".join(f"{d}[{','.join(map(str, s))}]" for d, s in ins.types)


def _target(ins: Instr) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
    return m.group(1) if m else ""


def instr_traffic(ins: Instr, comps: dict[str, list[Instr]], operand_bytes: list[int],
                  nominal: list[int] | None = None) -> tuple[str, str, list[int], int]:
    """(category, op, HBM bytes read of each operand, HBM bytes written) of one instruction that runs (not FREE, not
    a control-flow op). operand_bytes: each operand's HBM bytes (0: it lives in VMEM); nominal: their bytes wherever
    they live (default operand_bytes). A collective's bytes are its result's, as written (over the interconnect)."""
    nominal = list(operand_bytes) if nominal is None else nominal
    base = ins.op.removesuffix("-start")
    if base in COLLECTIVES or base in ("send", "recv"):
        d, s = ins.types[-1]
        return "collective", base, [0] * len(operand_bytes), math.prod(s) * _BYTES.get(d, 4)
    if ins.op == "custom-call":
        t = _target(ins)
        cat = "kernel" if t in PALLAS_TARGETS else "matmul" if re.search("gemm|matmul|cublas", t) else "outside"
        return cat, f"custom-call:{t}", list(operand_bytes), ins.hbm_bytes
    if ins.op == "fusion":
        kind = re.search(r"kind=(k[A-Za-z]+)", ins.attrs)
        cat = "matmul" if _has_dot(ins.attr("calls") or "", comps) else "outside"
        return (cat, f"fusion:{kind.group(1) if kind else ''}", *fusion_io(ins, comps, operand_bytes))
    if ins.op == "copy-start":  # result (destination, source, context): one copy is written (none into VMEM)
        return "outside", ins.op, list(operand_bytes), array_bytes(ins.types[0]) if ins.in_hbm(0) else 0
    if ins.op == "slice-start":  # result ((source), slice, context): reads the slice of its source, writes it
        part = array_bytes(ins.types[1])
        return "outside", ins.op, [part if operand_bytes[0] else 0, *operand_bytes[1:]], part * ins.in_hbm(1)
    if ins.op in _SLICING:
        return "outside", ins.op, [ins.bytes if operand_bytes[0] else 0, *operand_bytes[1:]], ins.hbm_bytes
    if ins.op in _IN_PLACE:
        i = _IN_PLACE[ins.op]
        upd = nominal[i] if len(nominal) > i else ins.bytes
        return "outside", ins.op, [0, *operand_bytes[1:]], upd * ins.in_hbm(0)
    cat = "matmul" if ins.op in ("dot", "convolution") else "outside"
    return cat, ins.op, list(operand_bytes), ins.hbm_bytes


@dataclass(frozen=True)
class Row:
    """`count` runs of one kind of traffic (Traffic fields) per execution of the module."""

    traffic: Traffic
    count: int


def _weights(instrs: list[Instr], is_weight: Callable[[Instr], bool]) -> set[str]:
    """Names of the weight parameters among `instrs` and of the bitcasts of them (views that move nothing)."""
    out = {i.name for i in instrs if i.op == "parameter" and is_weight(i)}
    for i in instrs:
        if i.op == "bitcast" and i.operands and i.operands[0] in out:
            out.add(i.name)
    return out


_ROWS_ONLY = re.compile(r"""op_name="state\[\\?'embed\\?'\]""")  # a weight whose batch rows the minimum counts


def _prefetched_whole(instrs: list[Instr]) -> set[str]:
    """Names of the VMEM prefetches of a weight the minimum counts only the batch's rows of (the embedding)."""
    part = _weights(instrs, lambda p: bool(_ROWS_ONLY.search(p.attrs)))
    return {i.name for i in instrs if i.op in ("copy-start", "slice-start") and i.operands and i.operands[0] in part}


def jaxserve_weight(param: Instr) -> bool:
    """A jaxserve program's weight parameter: its metadata names the model state (`state['layers'][0]...` in the
    plan's programs, `params[3]` in the engine's, which take the weights as a flat list)."""
    return 'op_name="state[' in param.attrs or 'op_name="params[' in param.attrs


_PREFETCH_VIEWS = frozenset({"copy-done", "slice-done", "bitcast", "get-tuple-element", "custom-call"})


def _feed_kernels(instrs: list[Instr]) -> set[str]:
    """Names of the VMEM prefetches (copy-start / slice-start) whose buffer a Pallas kernel reads: through their
    -done halves, bitcasts and the ConcatBitcast joining slices."""
    users = _users(instrs)
    out = set()
    for ins in instrs:
        if ins.op not in ("copy-start", "slice-start"):
            continue
        todo, seen = [ins.name], set()
        while todo and ins.name not in out:
            for u, _ in users.get(todo.pop(), []):
                if u.op == "custom-call" and _target(u) in PALLAS_TARGETS:
                    out.add(ins.name)
                elif u.op in _PREFETCH_VIEWS and u.name not in seen and (
                        u.op != "custom-call" or _target(u) == "ConcatBitcast"):
                    seen.add(u.name)
                    todo.append(u.name)
    return out


def _walk(name: str, comps: dict[str, list[Instr]], times: int, out: Counter,
          is_weight: Callable[[Instr], bool], depth: int = 0) -> None:
    instrs = comps.get(name, [])
    by_name = {i.name: i for i in instrs}
    weights = _weights(instrs, is_weight)
    to_kernels = _feed_kernels(instrs) | _prefetched_whole(instrs)  # prefetches that are not a weight's read
    for ins in instrs:
        if ins.op in FREE or ins.op.endswith("-done"):
            continue
        if ins.op == "while":
            trip = _TRIP.search(ins.attrs)
            _walk(ins.attr("body") or "", comps, times * (int(trip.group(1)) if trip else 1), out, is_weight,
                  depth + 1)
            continue
        if ins.op in ("conditional", "call"):
            branches = re.findall(r"%([^\s,}]+)", ins.attrs.split("metadata=")[0])
            runs = [Counter() for _ in branches]
            for b, c in zip(branches, runs):
                _walk(b, comps, times, c, is_weight, depth + 1)
            if runs:  # a conditional runs one branch: the one that moves most, as a bound
                out.update(max(runs, key=lambda c: sum(t.bytes * n for t, n in c.items())))
            continue
        operand_bytes = [by_name[o].hbm_bytes if o in by_name else 0 for o in ins.operands]
        nominal = [by_name[o].bytes if o in by_name else 0 for o in ins.operands]
        cat, op, reads, written = instr_traffic(ins, comps, operand_bytes, nominal)
        from_weights = 0 if cat == "kernel" or ins.name in to_kernels else sum(r for o, r in zip(ins.operands, reads) if o in weights)
        what, result = _what(ins), _type_str(ins)
        rest = sum(reads) - from_weights + written
        if rest or not from_weights:  # a prefetch of a weight into VMEM is only its weight read
            out[Traffic(cat, op, what, result, rest)] += times
        if from_weights:
            out[Traffic("weights", op, what, result, from_weights)] += times


def traffic(text: str, is_weight: Callable[[Instr], bool] = jaxserve_weight) -> list[Row]:
    """Every instruction that runs in an HLO module's text, grouped: [Row], most bytes first. An instruction's reads
    of a weight parameter (`is_weight`) are a row of their own, category "weights" (what the roofline's minimum
    counts: reading each weight once); its other bytes stay in its category (a Pallas kernel's stay whole)."""
    comps, entry = parse(text)
    out: Counter = Counter()
    _walk(entry, comps, 1, out, is_weight)
    return sorted((Row(t, n) for t, n in out.items()), key=lambda r: -r.traffic.bytes * r.count)


def totals(rows: list[Row]) -> dict[str, int]:
    """Bytes per category over a module's rows."""
    out: dict[str, int] = {c: 0 for c in CATEGORIES}
    for r in rows:
        out[r.traffic.category] = out.get(r.traffic.category, 0) + r.traffic.bytes * r.count
    return out
