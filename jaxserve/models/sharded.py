"""The model's per-shard paths: every matmul, the MoE block, the vocab-parallel embedding and the paged attention
kernels run inside `jax.shard_map` with explicit per-device specs, so a compiled kernel (which has no SPMD
partitioning rule) only ever sees its own shard and the only collectives are the ones written here:

| op                       | per device                                    | collective                          |
|--------------------------|-----------------------------------------------|-------------------------------------|
| column-parallel linear   | x (replicated) @ W[:, local cols]             | none                                |
| row-parallel linear      | x[..., local rows] @ W[local rows, :]          | psum of [..., dout]                 |
| MoE (TP over expert FFN) | every expert, FFN slice; shared expert slice  | one psum of [tokens, hidden]        |
| MoE (expert parallel)    | the local experts' (token, slot) pairs        | one psum of [tokens, hidden]        |
| MoE under DP attention   | all-gather tokens over dp, local experts      | all-gather + psum_scatter over dp   |
| embedding (vocab split)  | rows of the local vocab slice, others 0       | psum of [tokens, hidden]            |
| paged attention          | local heads (TP) or local rows + pages (DP)   | none                                |

With activations replicated over "tp" (TP attention), expert dispatch needs no all-to-all: every device already
holds every token, selects the pairs routed to its experts and the combine is the same all-reduce TP needs.
`shard_model(model, parallel)` turns these paths on (they are static switches on the modules, like use_kernel).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.sharding import Parallel, ShardingError, check_model, param_axes, param_sharding

if TYPE_CHECKING:
    from jaxserve.models.layers import Linear, MoE
    from jaxserve.models.transformer import CausalLM


def _smap(par: Parallel, fn: Callable, in_specs: tuple, out_specs: object) -> Callable:
    # check_vma off: Pallas calls inside carry no varying-manual-axes annotations
    return jax.shard_map(fn, mesh=par.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _axes_tuple(axes: object) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _name(path: tuple) -> str:
    """Dotted parameter path of a pytree key path through an nnx.State (the Variable's own `.value` key dropped)."""
    keys = (getattr(k, "key", getattr(k, "idx", None)) for k in path if not isinstance(k, jax.tree_util.GetAttrKey))
    return ".".join(str(k) for k in keys)


def _state_specs(par: Parallel, prefix: str, state: nnx.State) -> nnx.State:
    """PartitionSpecs for a module's state (paths relative to the module at `prefix`), from the table."""
    def spec(path: tuple, x: jax.Array) -> P:
        name = _name(path)
        return par.spec(param_axes(f"{prefix}.{name}" if prefix else name, x.ndim))

    return jax.tree_util.tree_map_with_path(spec, state)


def linear(lin: Linear, x: jax.Array) -> jax.Array:
    """Column- or row-parallel linear by the weight's logical axes. x [..., din] -> [..., dout]."""
    par = lin.parallel
    axes = param_axes(f"{lin.path}.weight", 2)
    k_ax, n_ax = par.axis(axes[0]), par.axis(axes[1])
    if k_ax is None and n_ax is None:
        return lin.local(x, lin.weight[...], None if lin.scale is None else lin.scale[...],
                         None if lin.bias is None else lin.bias[...])
    if k_ax is not None and n_ax is not None:
        raise ShardingError(f"{lin.path}: both dims of a linear are split", value=axes, param=lin.path)
    lead = (par.axis("batch"),) + (None,) * (x.ndim - 2)
    args = {"w": lin.weight[...]}
    specs = {"w": P(k_ax, n_ax)}
    if lin.scale is not None:
        args["s"], specs["s"] = lin.scale[...], P(k_ax, n_ax)
    if lin.bias is not None:
        args["b"], specs["b"] = lin.bias[...], P(n_ax)

    def body(x: jax.Array, a: dict[str, jax.Array]) -> jax.Array:
        if k_ax is None:
            return lin.local(x, a["w"], a.get("s"), a.get("b"))
        y = jax.lax.psum(lin.local(x, a["w"], a.get("s"), None), k_ax)  # partial sums over the split input dim
        return y if "b" not in a else y + a["b"].astype(y.dtype)

    return _smap(par, body, (P(*lead, k_ax), specs), P(*lead, n_ax))(x, args)


def _mlp_local(mlp: nnx.Module, x: jax.Array) -> jax.Array:
    """A SwiGLU MLP on its local (FFN-split) arrays: a partial sum of its output. x [N, H] -> [N, H]."""
    def run(lin: Linear, v: jax.Array) -> jax.Array:
        return lin.local(v, lin.weight[...], None if lin.scale is None else lin.scale[...], None)

    return run(mlp.down, jax.nn.silu(run(mlp.gate, x)) * run(mlp.up, x))


def moe(block: MoE, x: jax.Array) -> jax.Array:
    """Routed + shared experts with experts / expert FFN split over the mesh. x [B, T, H] -> [B, T, H]."""
    par = block.parallel
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    b_ax = par.axis("batch")
    routed_axes = _axes_tuple(par.axis("experts")) + _axes_tuple(par.axis("expert_ffn"))
    shared_axes = _axes_tuple(par.axis("ffn"))
    e_ax = par.axis("experts")
    graphdef, state = nnx.split(block)
    specs = _state_specs(par, block.path, state)

    def body(state: nnx.State, flat: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, state)
        tokens = flat if b_ax is None else jax.lax.all_gather(flat, b_ax, axis=0, tiled=True)
        w, ids = m.route(tokens)
        first = 0 if e_ax is None else jax.lax.axis_index(e_ax) * m.experts.gate.shape[0]
        y = m.routed(tokens, w, ids, first)
        shared = None if m.shared is None else _mlp_local(m.shared, flat).astype(jnp.float32)
        if shared is not None and b_ax is None and set(shared_axes) == set(routed_axes):
            y, shared = y + shared, None  # both partial over the same axes: one all-reduce for the block
        if b_ax is not None:
            y = jax.lax.psum_scatter(y, b_ax, scatter_dimension=0, tiled=True)  # back to this device's rows
            rest = tuple(a for a in routed_axes if a != b_ax)
            y = jax.lax.psum(y, rest) if rest else y
        elif routed_axes:
            y = jax.lax.psum(y, routed_axes)
        out = y.astype(flat.dtype)
        if shared is not None:
            shared = jax.lax.psum(shared, shared_axes) if shared_axes else shared
            out = out + shared.astype(flat.dtype)
        return out

    # the routed sum is taken in f32 and cast once, as the unsharded path does
    out = _smap(par, body, (specs, P(b_ax)), P(b_ax))(state, flat)
    return out.reshape(shape)


def embed(model: CausalLM, tokens: jax.Array) -> jax.Array:
    """Vocab-parallel lookup: each device holds a vocab slice; rows outside it are 0; one psum.
    tokens [B, T] int32 -> [B, T, H] model dtype."""
    par = model.parallel
    v_ax, b_ax = par.axis("vocab"), par.axis("batch")
    table = model.embed[...]
    if v_ax is None:
        return jnp.take(table, tokens, axis=0)

    def body(tokens: jax.Array, table: jax.Array) -> jax.Array:
        start = jax.lax.axis_index(v_ax) * table.shape[0]
        local = tokens - start
        inside = (local >= 0) & (local < table.shape[0])
        rows = jnp.take(table, jnp.where(inside, local, 0), axis=0)
        return jax.lax.psum(jnp.where(inside[..., None], rows, 0), v_ax)

    return _smap(par, body, (P(b_ax, None), P(v_ax, None)), P(b_ax, None, None))(tokens, table)


def tied_logits(model: CausalLM, h: jax.Array) -> jax.Array:
    """Logits through the (vocab-split) embedding table: h [..., H] -> [..., V] f32, split over vocab."""
    par = model.parallel
    v_ax, b_ax = par.axis("vocab"), par.axis("batch")
    lead = (b_ax,) + (None,) * (h.ndim - 2)

    def body(h: jax.Array, table: jax.Array) -> jax.Array:
        return jnp.dot(h, table.T.astype(h.dtype), preferred_element_type=jnp.float32)

    return _smap(par, body, (P(*lead, None), P(v_ax, None)), P(*lead, v_ax))(h, model.embed[...])


def attention(par: Parallel, kernel: Callable, q: jax.Array, pools: tuple, tables: tuple, *, pool_axes: tuple,
              q_axes: tuple) -> jax.Array:
    """Run a paged attention kernel per shard. q [B, heads, ...] split by (batch, heads); pools (each page array
    and its scales, or None) split by their logical `pool_axes` (a tuple of axes per pool, pages first); tables
    (the block table [B, M] of global page ids first, then lengths [B], ...) split by batch. -> kernel output
    split like q. The pools may carry a leading layer axis: the page axis is found by its logical name.

    When the page axis is split (DP attention), each device holds pages [rank * P_local, (rank + 1) * P_local)
    and the kernel sees local ids: a block-table entry outside the device's range (padding, or a page of another
    rank) becomes the device's own null page 0, so a kernel never reads past its shard."""
    b_ax = par.axis("batch")
    p_ax = par.axis("pages")
    q_spec = P(*(par.axis(a) for a in q_axes))
    present = [i for i, p in enumerate(pools) if p is not None]
    pool_specs = tuple(P(*(par.axis(a) for a in pool_axes[i])) for i in present)
    table_specs = tuple(P(b_ax, *(None,) * (t.ndim - 1)) for t in tables)

    def body(q: jax.Array, local_pools: tuple, local_tables: tuple) -> jax.Array:
        full = [None] * len(pools)
        for i, p in zip(present, local_pools):
            full[i] = p
        if p_ax is not None:
            n_local = local_pools[0].shape[pool_axes[present[0]].index("pages")]
            first = jax.lax.axis_index(p_ax) * n_local
            bt = local_tables[0]
            bt = jnp.where((bt >= first) & (bt < first + n_local), bt - first, 0)
            local_tables = (bt, *local_tables[1:])
        return kernel(q, tuple(full), local_tables)

    fn = _smap(par, body, (q_spec, pool_specs, table_specs), q_spec)
    return fn(q, tuple(pools[i] for i in present), tuple(tables))


_PARALLEL_MODULES = ("Linear", "MoE", "CausalLM")


def shard_model(model: CausalLM, par: Parallel | None) -> CausalLM:
    """Switch `model`'s modules to their per-shard paths on `par` (None: back to single-device), in place.
    Checks every parameter's layout against the table first: a dim that does not divide raises ShardingError."""
    cfg = model.cfg
    if par is not None:
        check_model(par, cfg.num_heads, 0 if cfg.is_mla else cfg.num_kv_heads, cfg.n_routed_experts)
        _, state = nnx.split(model)
        for path, var in nnx.to_flat_state(state):
            param_sharding(par, ".".join(map(str, path)), var.get_value().shape)
    for path, module in nnx.iter_graph(model):
        if type(module).__name__ in _PARALLEL_MODULES:
            module.parallel = par
            module.path = ".".join(map(str, path))
    return model


def state_shardings(model: CausalLM, par: Parallel) -> nnx.State:
    """The NamedSharding of every parameter of `model` on `par` (a State-shaped tree)."""
    _, state = nnx.split(model)
    return jax.tree_util.tree_map_with_path(lambda p, x: param_sharding(par, _name(p), x.shape), state)
