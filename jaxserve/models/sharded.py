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
| DSA (indexer, top-k)     | every indexer head (TP) or local rows (DP)    | none                                |
| tag check, KV row writes | local rows into local pages (DP)              | none                                |
| hand-off import (TPU)    | the chunk's pages of the local page shard     | none                                |

With activations replicated over "tp" (TP attention), expert dispatch needs no all-to-all: every device already
holds every token, selects the pairs routed to its experts and the combine is the same all-reduce TP needs.
A module built with a `Parallel` (see `jaxserve.models.build`) runs its own per-shard method (`Linear.local`,
`MoE.local`, the embedding's lookup) through `per_shard`; the paged attention kernels run through `attention`, GLM-5's
sparse attention (`dsa.sparse_attention`) through `paged`. Under DP attention the tag check and the KV row writes
run per page shard too (`check_tags_per_shard`, `write_per_shard`): left to the SPMD partitioner, the check gathered
the whole tag array and each write gathered every row, and on TPU a row write into a page-split pool read and relaid
out the device's whole pool (Kimi K2.6 DP decode on v5p).
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.cache import KVPages, check_tags, insert_pages
from jaxserve.sharding import POOL_AXES, Parallel, state_specs

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
    """Run a paged attention kernel per shard: `paged` with one activation, q [B, heads, ...] split by `q_axes`
    (batch, heads), and the kernel's output split like q."""

    def body(acts: tuple, local_pools: tuple, local_tables: tuple) -> jax.Array:
        return kernel(acts[0], local_pools, local_tables)

    return paged(par, body, (q,), (q_axes,), pools, tables, pool_axes=pool_axes, out_axes=q_axes)


def paged(par: Parallel, fn: Callable, acts: tuple, act_axes: tuple, pools: tuple, tables: tuple, *,
          pool_axes: tuple, out_axes: object) -> object:
    """fn(acts, pools, tables) per shard over the page pool. acts: activations (each an array, a tuple of arrays
    or None), each split by its logical axes in `act_axes` (a tuple of axes applies to every array of a tuple);
    pools (each page array and its scales, or None) split by their logical `pool_axes` (a tuple of axes per pool,
    pages first); tables (the block table [B, M] of global page ids first, then per-row arrays [B, ...]) split by
    batch. out_axes: the logical axes of fn's output (one tuple), or a tuple of them for a tuple of outputs.
    The pools may carry a leading layer axis: the page axis is found by its logical name.

    When the page axis is split (DP attention), each device holds pages [rank * P_local, (rank + 1) * P_local)
    and fn sees local ids: a block-table entry outside the device's range (padding, or a page of another rank)
    becomes the device's own null page 0, so fn never reads past its shard. An output whose axes leave a mesh
    axis unsplit must be the same on every device of it (fn computes it redundantly; nothing checks)."""
    spec = lambda axes: P(*(par.axis(a) for a in axes))  # noqa: E731
    b_ax = par.axis("batch")
    p_ax = par.axis("pages")
    present = [i for i, p in enumerate(pools) if p is not None]
    pool_specs = tuple(spec(pool_axes[i]) for i in present)
    table_specs = tuple(P(b_ax, *(None,) * (t.ndim - 1)) for t in tables)
    nested = isinstance(out_axes, tuple) and bool(out_axes) and isinstance(out_axes[0], tuple)
    out_specs = tuple(spec(a) for a in out_axes) if nested else spec(out_axes)

    def body(acts: tuple, local_pools: tuple, local_tables: tuple) -> object:
        full = [None] * len(pools)
        for i, p in zip(present, local_pools):
            full[i] = p
        if p_ax is not None:
            n_local = local_pools[0].shape[pool_axes[present[0]].index("pages")]
            first = jax.lax.axis_index(p_ax) * n_local
            bt = local_tables[0]
            bt = jnp.where((bt >= first) & (bt < first + n_local), bt - first, 0)
            local_tables = (bt, *local_tables[1:])
        return fn(acts, tuple(full), local_tables)

    act_specs = tuple(spec(a) for a in act_axes)
    run = par.shard_map(body, (act_specs, pool_specs, table_specs), out_specs)
    return run(tuple(acts), tuple(pools[i] for i in present), tuple(tables))


def pages_split(par: Parallel | None) -> bool:
    """The page pool is split over the mesh (DP attention): each device holds its own rows' pages."""
    return par is not None and par.axis("pages") is not None


def _local(par: Parallel, ids: jax.Array, n_local: int) -> jax.Array:
    """Global ids (pages, or slots with n_local counted in slots) -> this device's local ids; an id of another
    shard (or padding) -> -1."""
    first = jax.lax.axis_index(par.axis("pages")) * n_local
    return jnp.where((ids >= first) & (ids < first + n_local), ids - first, -1)


def check_tags_per_shard(par: Parallel, tags: jax.Array, block_tables: jax.Array, expected_tags: jax.Array,
                         num_pages: jax.Array) -> jax.Array:
    """`cache.check_tags` per page shard: each device checks its own rows against its own tags. A page of another
    shard fails its row (a row's pages all live on its rank). tags [P]; block_tables, expected_tags [B, M]
    (global page ids); num_pages [B] -> ok [B] bool."""
    rows = P(par.axis("batch"))

    def body(tags: jax.Array, bt: jax.Array, expected: jax.Array, n: jax.Array) -> jax.Array:
        return check_tags(tags, _local(par, bt, tags.shape[0]), expected, n)

    return par.shard_map(body, (P(par.axis("pages")), rows, rows, rows), rows)(tags, block_tables, expected_tags,
                                                                              num_pages)


def write_per_shard(par: Parallel, write: Callable, pages: KVPages, rows: object, slots: jax.Array,
                    slot_tags: jax.Array | None) -> KVPages:
    """write(pages, rows, slots, slot_tags) -> pages (`cache.write_tokens` and kin) per page shard: each device
    writes its own rows into its own pages. rows: an array [N, ...] or a tuple of them, split by row like slots
    [N] int32 (global `page * page_size + offset`; a slot of another shard is dropped there) and slot_tags [N]."""
    specs = KVPages(pages.layout, **{f: par.spec(POOL_AXES[f]) for f in POOL_AXES if getattr(pages, f) is not None})
    row = P(par.axis("batch"))
    n_slots = pages.num_pages // par.size("pages") * pages.layout.page_size

    def body(pages: KVPages, rows: object, slots: jax.Array, slot_tags: jax.Array | None) -> KVPages:
        return write(pages, rows, _local(par, slots, n_slots), slot_tags)

    row_specs = jax.tree.map(lambda _: row, rows)
    return par.shard_map(body, (specs, row_specs, row, None if slot_tags is None else row), specs)(
        pages, rows, slots, slot_tags)


def import_fn(par: Parallel) -> Callable:
    """The hand-off's import (`cache.insert_pages`' signature) for a decode mesh: as is, or on TPU per device with
    the value pages DMA'd in place (`insert_pages(dma="tpu")`: a Mosaic kernel has no partitioning rule, so it
    runs in a shard_map). XLA:TPU's scatter relaid out a whole 8-bit pool around the write (Kimi K2.6 on v5p)."""
    if par.mesh.devices.flat[0].platform != "tpu":
        return insert_pages
    return functools.partial(insert_per_shard, par)


def insert_per_shard(par: Parallel, dst: KVPages, chunk: KVPages, dst_page_ids: jax.Array,
                     expected_src_tags: jax.Array | None = None, dst_tags: jax.Array | None = None,
                     groups: jax.Array | None = None, *, dma: str = "tpu") -> KVPages:
    """`insert_pages(dma=dma)` ("tpu"; "interpret" in tests) per page shard: every device gets the whole chunk (split
    like its pool but not by page) and the tags, checks every page's tag (the same verdict on every shard) and
    writes the pages its shard holds; dst_page_ids [n] int32 global (negative: padding). A page of another shard
    is live (its tag is checked) but dropped here."""
    pool_specs = {f: par.spec(POOL_AXES[f]) for f in POOL_AXES if getattr(dst, f) is not None}
    unpaged = lambda axes: tuple(None if a == "pages" else a for a in axes)  # noqa: E731
    chunk_specs = KVPages(chunk.layout, **{f: par.spec(unpaged(POOL_AXES[f])) for f in POOL_AXES
                                           if getattr(chunk, f) is not None})
    n_local = dst.num_pages // par.size("pages")

    def body(dst: KVPages, chunk: KVPages, ids: jax.Array, *tags: jax.Array | None) -> KVPages:
        first = 0 if par.axis("pages") is None else jax.lax.axis_index(par.axis("pages")) * n_local
        local = jnp.where((ids >= first) & (ids < first + n_local), ids - first, n_local)
        return insert_pages(dst, chunk, jnp.where(ids < 0, -1, local), *tags, dma=dma)

    tags = (expected_src_tags, dst_tags, groups)
    specs = KVPages(dst.layout, **pool_specs)
    return par.shard_map(body, (specs, chunk_specs, P(), *(None if t is None else P() for t in tags)), specs)(
        dst, chunk, dst_page_ids, *tags)
