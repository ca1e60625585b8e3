"""One phase's real program (decode step, or one prefill chunk over a long context) lowered and compiled for a plan's
mesh on abstract weights and pool, and what the compiler reported: `memory_analysis()` (arguments, outputs,
temporaries, code, aliased) and, from the compiled HLO text, every collective, every copy / transpose /
all-gather whose result has the shape of a weight or a page-pool array (a weight or pool moved or relaid out per
call), and every fusion that writes a whole pool-shaped buffer (a pool or one layer of it copied by a fusion, such
as the `slice` fusion XLA:GPU made to give a kernel its own layer buffer). Used by `jaxserve plan`
(jaxserve/plan.py), which compiles a few layers and scales to the model's count.
"""
from __future__ import annotations

import functools
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field

from jaxserve.hlo import _BYTES, collectives, summarize
from jaxserve.hlo_bytes import Instr, Row, _types, parse, traffic

MEMORY_FIELDS = ("argument", "output", "temp", "generated_code", "alias")
_MOVE = re.compile(r"%(\S+) = ([a-z0-9]+)\[([0-9,]*)\](\{[^}]*\})? (copy|transpose|all-gather)(?:-start)?\("
                   r"%([^\s,)]+)(?:[^\n]*?dimensions=\{([0-9,]*)\})?")
_LAYOUT = re.compile(r"%(\S+) = [a-z0-9]+\[[0-9,]*\](\{[^}]*\})")
_SPACE = re.compile(r"S\(\d+\)")  # a memory space (VMEM): a copy into it is a prefetch, not a relayout
VERIFY_DRAFTS = 3  # the "verify" phase's drafts a row (EngineConfig's speculative k: any; ngram:3 in the README)
_MIN_TRACKED = 1 << 20  # weights / pool arrays under 1 MiB are not tracked (their shapes collide with activations)


@dataclass
class PhaseCompile:
    """memory: MEMORY_FIELDS -> bytes per device; collectives: hlo.summarize rows; moves: copies / transposes /
    all-gathers of a weight or pool shape, and fusions writing a whole pool shape (op "fusion") [{op, of, dtype,
    shape, layout, count, bytes}]; traffic: every
    instruction that runs, grouped (hlo_bytes.traffic) [{category, op, what, result, count, bytes}], a whole
    pool's leading layer dim written "L" (the roofline's input, jaxserve/roofline.py); pool_pages: the compiled
    pool's pages (all page shards, null pages included)."""

    seconds: float
    memory: dict[str, int]
    collectives: list[dict] = field(default_factory=list)
    moves: list[dict] = field(default_factory=list)
    traffic: list[dict] = field(default_factory=list)
    pool_pages: int = 0


def _tracked_shapes(state, pages) -> dict[tuple[int, ...], str]:  # noqa: ANN001
    """Shapes (global, per-device shard, and one layer of a pool) of the weights and pool arrays -> "weight" |
    "pool.<field>"."""
    import jax

    out: dict[tuple[int, ...], str] = {}

    def add(x, what: str) -> None:  # noqa: ANN001
        if x is None or math.prod(x.shape) * x.dtype.itemsize < _MIN_TRACKED:
            return
        shard = tuple(x.sharding.shard_shape(x.shape))
        if what == "weight":
            out.setdefault(tuple(x.shape), what)
            out.setdefault(shard, what)
        else:  # a pool: all layers (its shape holds the compiled layer count: not scaled) or one layer's slice
            out.setdefault(tuple(x.shape), what + " (all layers)")
            out.setdefault(shard, what + " (all layers)")
            out.setdefault(tuple(x.shape[1:]), what)
            out.setdefault(shard[1:], what)
            if what[5:] in ("k", "v", "k_scale", "v_scale"):  # a GQA layer as a kernel's rows [P, ps * Hkv, ...]
                out.setdefault((shard[1], shard[2] * shard[3], *shard[4:]), what)
            # and with unit dims dropped, as XLA holds a device's one kv head (TP): f32[L, P, ps] is its scale pool
            out.setdefault(tuple(d for d in shard if d != 1), what + " (all layers)")
            out.setdefault(tuple(d for d in shard[1:] if d != 1), what)

    for x in jax.tree.leaves(state):
        add(x, "weight")
    for f in ("latent", "latent_scale", "k", "v", "k_scale", "v_scale", "index_k", "index_k_scale"):
        add(getattr(pages, f), f"pool.{f}")
    return out


def _written(comps: dict[str, list[Instr]]) -> set[str]:
    """Names of the instructions whose result is written to memory: every instruction of a computation that is not
    a fusion's body, and each fusion's root (through views, tuples and nested fusions' roots). Inside a fusion an
    op's result stays on chip: XLA:TPU unpacks an FP8 weight's (32, 128) tiles to (8, 128) there before the convert
    that dequantizes it (a nested `copy` of the weight's shape, reading the weight once as the dot does)."""
    fused = {i.attr("calls") for body in comps.values() for i in body if i.op == "fusion"}
    out: set[str] = set()

    def roots(name: str, depth: int) -> None:
        body = comps.get(name, [])
        by_name = {i.name: i for i in body}
        todo = [i for i in body if i.root]
        while todo:
            r = todo.pop()
            out.add(r.name)
            if r.op in ("bitcast", "reshape", "tuple"):
                todo += [by_name[o] for o in r.operands if o in by_name]
            elif r.op == "fusion" and depth < 8:
                roots(r.attr("calls") or "", depth + 1)

    for name, body in comps.items():
        if name not in fused:
            for i in body:
                out.add(i.name)
                if i.op == "fusion":
                    roots(i.attr("calls") or "", 0)
    return out


def moves(hlo_text: str, tracked: dict[tuple[int, ...], str]) -> list[dict]:
    """Copies, transposes and all-gathers in `hlo_text` whose result shape is a tracked weight / pool shape (a pool's
    with any unit dims) and is written to memory (`_written`). A transpose that keeps its operand's element order
    and layout (memory space aside) moves nothing and is not one: XLA:TPU's gather fusions end in an identity
    transpose, whose [64 * 8, 6144] rows (the MoE's routed rows) have the shape of GLM-5.2's o_proj shard at 32
    chips."""
    layouts = {m.group(1): _SPACE.sub("", m.group(2)) for m in _LAYOUT.finditer(hlo_text)}
    written = _written(parse(hlo_text)[0])
    hits: Counter = Counter()
    for m in _MOVE.finditer(hlo_text):
        name, dt, dims, layout, op, operand, perm = m.groups()
        shape = tuple(int(d) for d in dims.split(",") if d)
        of = tracked.get(shape) or tracked.get(tuple(d for d in shape if d != 1), "")
        if not (shape in tracked or of.startswith("pool")) or name not in written:
            continue  # a pool also with unit dims moved or dropped (a GQA scale pool [L, 1, P, ps] or [L, P, ps])
        identity = perm is None or perm == ",".join(map(str, range(len(shape))))
        if op == "transpose" and identity and layout and layouts.get(operand) == _SPACE.sub("", layout):
            continue  # a view (a copy in the same layout still writes a second buffer)
        hits[(op, of, dt, shape, layout or "")] += 1
    return [{"op": op, "of": of, "dtype": dt, "shape": list(s), "layout": lay, "count": n,
             "bytes": math.prod(s) * _BYTES.get(dt, 4)} for (op, of, dt, s, lay), n in hits.items()]


def fusion_copies(rows: list[Row], tracked: dict[tuple[int, ...], str]) -> list[dict]:
    """Fusions (outside the kernels) whose one result has a tracked pool shape, leading unit dims aside (a layer
    slice is [1, P, ps, D]), and which write all of it: a copy of the pool or a layer of it, per step (loop trip
    counts included). An in-place update of the pool writes only its rows (hlo_bytes), so it is not one."""
    hits: Counter = Counter()
    for r in rows:
        t, types = r.traffic, _types(r.traffic.result)
        if t.category != "outside" or not t.op.startswith("fusion") or len(types) != 1:
            continue
        dt, shape = types[0]
        squeezed = shape[next((i for i, d in enumerate(shape) if d != 1), len(shape)):]
        of = tracked.get(shape, tracked.get(squeezed, ""))
        if of.startswith("pool") and t.bytes >= math.prod(shape) * _BYTES.get(dt, 4):
            hits[(of, dt, shape)] += r.count
    return [{"op": "fusion", "of": of, "dtype": dt, "shape": list(s), "layout": "", "count": n,
             "bytes": math.prod(s) * _BYTES.get(dt, 4)} for (of, dt, s), n in hits.items()]


def compile_phase(cfg, model, par, spec, phase: str, attention: str = "xla",  # noqa: ANN001
                  in_mesh: bool = False, pool_pages: int | None = None) -> PhaseCompile:
    """Lower and compile one phase's real program on abstract inputs: "decode", "prefill", or "verify" (the
    speculative verify: `VERIFY_DRAFTS` drafts + 1 positions a decode row over the decode pool). in_mesh: lower
    inside `jax.set_mesh` (the Pallas TPU kernels read their chip from the mesh's devices). pool_pages: the pool's
    pages exactly (a multiple of the page shards: the pool a plan says fits, fewer than the rows' pages when they
    do not all fit); None: the rows' pages + a null page per shard, or spec.pool_pages if more."""
    import contextlib

    import jax
    from flax import nnx

    from jaxserve.cache import init_pages
    from jaxserve.engine.batch import dummy_decode, dummy_prefill
    from jaxserve.engine.layouts import kv_layout, prefill_kv_dtype
    from jaxserve.engine.programs import _pool_shardings, decode_step, prefill_step
    from jaxserve.engine.verify import dummy_verify, verify_step
    from jaxserve.models.attention_backend import AttentionBackend
    from jaxserve.sharding import state_formats

    graphdef, state = nnx.split(model)
    state = _with_shardings(state, state_formats(par, state))
    rows = par.sharding(("batch",))
    dp = par.size("pages")
    ps = spec.page_size
    on_decode = phase in ("decode", "verify")  # the decode pool and rows
    kv = spec.kv_dtype if on_decode else prefill_kv_dtype(spec.kv_dtype)
    layout = kv_layout(cfg, ps, kv)
    ctx = spec.decode_context if on_decode else spec.prefill_context
    m = -(-ctx // ps)
    b = spec.decode_rows if on_decode else dp
    num_pages = dp * (-(-b // dp) * m + 1)  # each page shard: its rows' pages + its null page
    if phase == "decode" and spec.pool_pages:  # a deployment's pool (what the plan says fits), page shards whole
        num_pages = max(num_pages, -(-spec.pool_pages // dp) * dp)
    num_pages = num_pages if pool_pages is None else pool_pages
    pages = jax.eval_shape(lambda: init_pages(layout, num_pages))
    pool_shardings = _pool_shardings(pages, par)
    pages = _with_shardings(pages, pool_shardings)
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), tree)  # noqa: E731
    backend = AttentionBackend(attention)
    t0 = time.perf_counter()
    if phase == "decode":
        batch, samp = dummy_decode(b, m)
        # the pool is donated and comes back in its own layout, so it is updated in place (as in Programs)
        step = functools.partial(decode_step, graphdef, integrity=True, attention=backend)
    elif phase == "verify":  # (batch, drafts) as one argument: the other phases' signature
        *batch, samp = dummy_verify(b, VERIFY_DRAFTS, m)

        def step(st, pg, batch_drafts, sa):  # noqa: ANN001, ANN202
            return verify_step(graphdef, st, pg, *batch_drafts, sa, integrity=True, attention=backend)
    else:
        batch, samp = dummy_prefill(b, spec.prefill_chunk, m)
        step = functools.partial(prefill_step, graphdef, attention=backend)
    fn = jax.jit(step, donate_argnums=(1,), out_shardings=(rows, rows, pool_shardings))
    with jax.set_mesh(par.mesh) if in_mesh else contextlib.nullcontext():
        compiled = fn.lower(state, pages, abstract(batch), abstract(samp)).compile()
    seconds = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    memory = {f: int(getattr(ma, f"{f}_size_in_bytes")) for f in MEMORY_FIELDS}
    hlo = compiled.as_text()
    pool_shapes = [tuple(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(pages) if x.ndim >= 2]
    tracked, runs = _tracked_shapes(state, pages), traffic(hlo)
    return PhaseCompile(seconds, memory, summarize(collectives(hlo)),
                        moves(hlo, tracked) + fusion_copies(runs, tracked), traffic_rows(runs, pool_shapes), num_pages)


def traffic_rows(rows: list[Row], pool_shapes: list[tuple[int, ...]]) -> list[dict]:
    """hlo_bytes.traffic's rows as dicts, one per (category, op, what, result) with the mean bytes of its runs; a
    result of a whole pool's shape (its leading dim the compiled layer count) is written with "L" there, so that
    compiles at different layer counts match row by row (scaled)."""
    whole = {",".join(map(str, s)): ",".join(["L", *map(str, s[1:])]) for s in pool_shapes}
    runs: dict[tuple[str, ...], list[int]] = {}
    for r in rows:
        t = r.traffic
        result = re.sub(r"\[([0-9,]+)\]", lambda m: f"[{whole.get(m.group(1), m.group(1))}]", t.result)
        acc = runs.setdefault((t.category, t.op, t.what, result), [0, 0])
        acc[0] += r.count
        acc[1] += r.count * t.bytes
    return sorted(({"category": c, "op": o, "what": w, "result": res, "count": n, "bytes": round(b / n)}
                   for (c, o, w, res), (n, b) in runs.items()), key=lambda r: -r["bytes"] * r["count"])


def decode_step_shape(cfg, model, par):  # noqa: ANN001, ANN201
    """jaxserve.roofline.StepShape of a sharded abstract MLA model (TP attention, FP8 KV): per-device weight bytes
    split into what every decode step reads and the routed experts (read as the batch touches them)."""
    import jax
    from flax import nnx

    from jaxserve.cache import KVLayout
    from jaxserve.roofline import StepShape
    from jaxserve.sharding import state_shardings

    _, state = nnx.split(model)
    dense = routed = 0
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, x), s in zip(leaves, jax.tree.leaves(state_shardings(par, state))):
        p = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        b = math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
        if p.startswith("mtp") or p.startswith("embed"):
            continue  # the MTP head runs only to draft; of the embedding only the batch's rows (roofline)
        if ".experts." in f".{p}." and "shared" not in p:
            routed += b
        else:
            dense += b
    lay = KVLayout.mla(1, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype="fp8")  # one layer, FP8 + f32 scale
    index = cfg.index_head_dim + 4 if cfg.has_indexer else 0  # an FP8 indexer key + its f32 scale
    return StepShape(dense, routed, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.num_layers,
                     lay.bytes_per_token(), len(cfg.index_layers), index, cfg.index_topk if cfg.has_indexer else 0)


def _with_shardings(tree, shardings):  # noqa: ANN001, ANN202
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def scaled(a: PhaseCompile, la: int, b: PhaseCompile, lb: int, layers: int) -> PhaseCompile:
    """The compile at `layers` layers, extrapolated linearly from compiles at la < lb layers: every memory field and
    every collective / move count is f(lb) + (layers - lb) * (f(lb) - f(la)) / (lb - la) (each MoE layer is the
    same program; the per-layer slope of the temporaries is what layers add). A move of a whole pool (its shape
    holds the layer count) is reported as compiled at lb layers; its bytes grow with the layers. A memory field
    smaller at lb than at la (temporaries that do not grow with the layers: buffer reuse) stays at its lb value
    rather than extrapolating downwards."""
    k = (layers - lb) / (lb - la)
    ext = lambda fa, fb: max(int(round(fb + k * (fb - fa))), 0)  # noqa: E731
    memory = {f: ext(min(a.memory[f], b.memory[f]), b.memory[f]) for f in MEMORY_FIELDS}

    def rows(ra: list[dict], rb: list[dict], key: tuple[str, ...]) -> list[dict]:
        ca = {tuple(str(r[k_]) for k_ in key): r["count"] for r in ra}
        out = []
        for r in rb:  # a whole pool's shape holds the layer count: reported as compiled at lb layers
            whole = str(r.get("of", "")).endswith("(all layers)")
            n = r["count"] if whole else ext(ca.get(tuple(str(r[k_]) for k_ in key), 0), r["count"])
            out.append(dict(r, count=n))
        return sorted(out, key=lambda r: -int(r["bytes"]) * int(r["count"]))

    return PhaseCompile(a.seconds + b.seconds, memory,
                        rows(a.collectives, b.collectives, ("kind", "dtype", "shape")),
                        rows(a.moves, b.moves, ("op", "of", "dtype", "shape", "layout")),
                        rows(a.traffic, b.traffic, ("category", "op", "what", "result")), b.pool_pages)
