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
A module built with a `Parallel` (see `jaxserve.models.build`) runs its own per-shard method (`Linear.local`,
`MoE.local`, the embedding's lookup) through `per_shard`; the paged attention kernels run through `attention`.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.sharding import Parallel, state_specs

M = TypeVar("M", bound=nnx.Module)


def per_shard(module: M, fn: Callable[[M, jax.Array], jax.Array], x: jax.Array, x_spec: P, out_spec: P
              ) -> jax.Array:
    """fn(module, x) run per device on `module.parallel`'s mesh: the module's parameters split by their declared
    logical axes (fn sees the module holding its own shards), x split by `x_spec`; -> fn's output split by
    `out_spec`. fn writes the collectives."""
    graphdef, state = nnx.split(module)

    def body(state: nnx.State, x: jax.Array) -> jax.Array:
        return fn(nnx.merge(graphdef, state), x)

    par = module.parallel
    return par.shard_map(body, (state_specs(par, state), x_spec), out_spec)(state, x)


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

    fn = par.shard_map(body, (q_spec, pool_specs, table_specs), q_spec)
    return fn(q, tuple(pools[i] for i in present), tuple(tables))
