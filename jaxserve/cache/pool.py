"""Device page pools (`KVPages`) and the programs over them: scatter of new tokens, gathers, the prefill -> decode
hand-off, DSA indexer keys, and the device tag array.

Pools are stored as bit patterns: uint8 for FP8, uint16 for BF16 (uint32 for the f32 reference pool). XLA:CPU cannot
scatter float8/bfloat16 natively, so a float8 pool made it convert the whole pool to f16/f32 and back around every
write; integer pools scatter in place. `lax.bitcast_convert_type` at the edges (writes, gathers, `KVPages.layer`,
the hand-off) turns bits into values only for the rows actually read or written. Consumers of `KVPages.layer` see
float8_e4m3fn / bfloat16 arrays; the raw fields (`latent`, `k`, `v`) hold the bits.

FP8 pools store `float8_e4m3fn` values plus one float32 scale per token (MLA) or per token and kv head (GQA):
`x ~= q.astype(f32) * scale`, `scale = amax(|row|) / 448`. Quantization saturates (clips to +-448 before the
cast) so it never produces NaN from finite or infinite inputs; an all-zero row gets scale 1 (dequant gives 0).

Tags: `KVPages.tags` [pages] uint32 is the device's witness of each page's generation. The host sets it when a
page is allocated (its new tag) or freed (0, "no generation"; `PageAllocator.sync_device_tags` through
`scatter_tags`); every KV write (`write_tokens` with `slot_tags`, `insert_pages`) stamps the writer's tag for the
page it writes, in the same program as the data. A write through a stale slot therefore leaves a tag its page's
owner does not expect, and the owner's next read (`integrity.check_tags`) fails closed.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.page_copy_tpu import copy_pages_tpu
from pallas_kernels.paged_attention_tpu import head_major, scale_rows

from jaxserve.cache.layout import FP8_DTYPE, FP8_MAX, KVLayout
from jaxserve.errors import ConfigError
from jaxserve.format_names import KVDtype


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["latent", "latent_scale", "k", "v", "k_scale", "v_scale", "tags", "index_k",
                                "index_k_scale"],
                   meta_fields=["layout"])
@dataclass(frozen=True)
class KVPages:
    """Device page pool. Unused fields are None. Values fields hold bit patterns (`layout.storage_dtype`:
    uint16 for BF16 pools, uint8 for FP8 pools); `layer()` returns value views.

    MLA: latent [layers, pages, page_size, latent_dim] uint16|uint8,
         latent_scale [layers, pages, page_size] f32 (fp8).
    GQA: k, v [layers, pages, page_size, kv_heads, head_dim] uint16|uint8,
         k_scale, v_scale [layers, pages, page_size, kv_heads] f32 (fp8).
    tags [pages] uint32: the generation each page was last allocated / written with (0: free); see the module
    docstring. A hand-off chunk carries the tags of its source pages.
    DSA: index_k [index_layers, pages, page_size, index_head_dim] uint16|uint8 (`layout.index_layout`),
         index_k_scale [index_layers, pages, page_size] f32 (fp8 keys).
    """

    layout: KVLayout
    latent: jax.Array | None = None
    latent_scale: jax.Array | None = None
    k: jax.Array | None = None
    v: jax.Array | None = None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    tags: jax.Array | None = None
    index_k: jax.Array | None = None
    index_k_scale: jax.Array | None = None

    @property
    def num_pages(self) -> int:
        return (self.latent if self.layout.kind == "mla" else self.k).shape[1]

    def nbytes(self) -> int:
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

    @classmethod
    def from_values(cls, layout: KVLayout, **fields: jax.Array | None) -> KVPages:
        """A pool from value arrays (bf16 / float8_e4m3fn, or already bits): values fields are bitcast to bits."""
        bits = {"latent", "k", "v"}
        lay = lambda n: layout.index_layout if n == "index_k" else layout  # noqa: E731
        return cls(layout, **{n: to_bits(x, lay(n)) if n in bits | {"index_k"} and x is not None else x
                              for n, x in fields.items()})

    def layer(self, layer: int | jax.Array) -> tuple[jax.Array | None, ...]:
        """One layer's arrays, in kernel order: MLA (latent, latent_scale); GQA (k, v, k_scale, v_scale).

        Values come as `layout.jnp_dtype` (bf16 / float8_e4m3fn) bitcast views of the stored bits, scales f32.
        """
        lay = self.layout
        pick = lambda x: None if x is None else x[layer]  # noqa: E731
        view = lambda x: None if x is None else from_bits(x[layer], lay)  # noqa: E731
        if lay.kind == "mla":
            return view(self.latent), pick(self.latent_scale)
        return view(self.k), view(self.v), pick(self.k_scale), pick(self.v_scale)

    def gather_layer(self, layer: int | jax.Array, block_tables: jax.Array
                     ) -> tuple[tuple[jax.Array | None, ...], jax.Array]:
        """The pages `block_tables` [B, M] int32 names, gathered as bits and then viewed as values, with the block
        table renumbered to index them: `(arrays in layer() order, local_tables [B, M] int32)`.

        Arrays hold B*M pages: MLA latent [B*M, ps, latent_dim], scale [B*M, ps]; GQA k, v [B*M, ps, kv_heads,
        head_dim], scales [B*M, ps, kv_heads]. For attention written as pool[block_table] in XLA (the reference
        path): XLA:CPU cannot gather bf16 / float8, so gathering a `layer()` view converts that layer's whole pool
        to f32 first; here only the B*M pages read are converted.
        """
        lay = self.layout
        b, m = block_tables.shape
        flat = block_tables.reshape(-1).astype(jnp.int32)
        pick = lambda x: None if x is None else x[layer][flat]  # noqa: E731
        view = lambda x: None if x is None else from_bits(x[layer][flat], lay)  # noqa: E731
        local = jnp.arange(b * m, dtype=jnp.int32).reshape(b, m)
        if lay.kind == "mla":
            return (view(self.latent), pick(self.latent_scale)), local
        return (view(self.k), view(self.v), pick(self.k_scale), pick(self.v_scale)), local


def to_bits(x: jax.Array, layout: KVLayout) -> jax.Array:
    """Values [...] (any float; cast to the layout's value dtype) -> their bits [...] `layout.storage_dtype`.

    An array already in the storage dtype is returned as is.
    """
    if x.dtype == layout.storage_dtype:
        return x
    return jax.lax.bitcast_convert_type(x.astype(layout.jnp_dtype), layout.storage_dtype)


def from_bits(x: jax.Array, layout: KVLayout) -> jax.Array:
    """Bits [...] `layout.storage_dtype` -> values [...] `layout.jnp_dtype` (a bitcast: no rounding, no copy
    beyond what XLA fuses)."""
    return jax.lax.bitcast_convert_type(x, layout.jnp_dtype)


def init_pages(layout: KVLayout, num_pages: int) -> KVPages:
    """Zero-filled pool (scales 1, tags 0: nothing allocated) of `num_pages` pages, every layer."""
    lead = (layout.num_layers, num_pages, layout.page_size)
    fp8 = layout.dtype == "fp8"
    dt = layout.storage_dtype  # all-zero bits are +0.0 in both bf16 and e4m3
    tags = jnp.zeros((num_pages,), jnp.uint32)
    if layout.kind == "mla":
        return KVPages(layout, latent=jnp.zeros((*lead, layout.latent_dim), dt),
                       latent_scale=jnp.ones(lead, jnp.float32) if fp8 else None, tags=tags,
                       **_init_index(layout, num_pages))
    kv_shape = (*lead, layout.kv_heads, layout.head_dim)
    sc = (lambda: jnp.ones((*lead, layout.kv_heads), jnp.float32)) if fp8 else (lambda: None)
    return KVPages(layout, k=jnp.zeros(kv_shape, dt), v=jnp.zeros(kv_shape, dt), k_scale=sc(), v_scale=sc(),
                   tags=tags)


def _init_index(layout: KVLayout, num_pages: int) -> dict[str, jax.Array | None]:
    """The indexer key fields of a zero pool (empty without an indexer cache)."""
    if not layout.index_layers:
        return {}
    il = layout.index_layout
    lead = (layout.index_layers, num_pages, layout.page_size)
    return {"index_k": jnp.zeros((*lead, layout.index_head_dim), il.storage_dtype),
            "index_k_scale": jnp.ones(lead, jnp.float32) if il.dtype == "fp8" else None}


def quantize_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row saturating FP8 quantization over the last axis.

    x [..., D] any float -> (q [..., D] float8_e4m3fn, scale [...] f32) with x ~= q * scale.
    Error per element <= max(|x| * 2^-4, scale * 2^-10) (3 mantissa bits; subnormal step 2^-9).
    """
    x = x.astype(jnp.float32)
    # clip amax so inf inputs give a finite scale (inf / scale -> inf -> clipped to 448, never NaN)
    amax = jnp.minimum(jnp.max(jnp.abs(x), axis=-1), jnp.finfo(jnp.float32).max)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    q = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """q [..., D] f8e4m3, scale [...] f32 -> [..., D] dtype."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def _slot_indices(slot_mapping: jax.Array, num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array]:
    """slot [N] int32 -> (page, offset) [N]; slot < 0 maps to page `num_pages`, out of bounds, so mode='drop' skips it."""
    slot_mapping = slot_mapping.astype(jnp.int32)
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # negative ids would wrap, not drop
    return page, jnp.where(slot_mapping < 0, 0, slot_mapping % page_size)


def _store(pool: jax.Array, layer: jax.Array, page: jax.Array, off: jax.Array, vals: jax.Array,
           layout: KVLayout | None = None, rowwise: bool = False) -> jax.Array:
    """Scatter vals [N, ...] at (layer, page[N], off[N]); with `layout`, vals are values turned into the pool's bits
    first (only the N new rows are converted, never the pool). rowwise: `_store_rows` instead of a scatter."""
    vals = to_bits(vals, layout) if layout is not None else vals.astype(pool.dtype)
    if rowwise:
        return _store_rows(pool, layer, page, off, vals)
    return pool.at[layer, page, off].set(vals, mode="drop")


def _store_rows(pool: jax.Array, layer: jax.Array, page: jax.Array, off: jax.Array, vals: jax.Array) -> jax.Array:
    """`_store` as a loop of one-row dynamic_update_slices, a row at page >= the pool's pages skipped. It updates
    the pool in place in any tiling: XLA:TPU's scatter takes an 8-bit pool only in (8, 128) tiles while a
    multi-device program's entry keeps it in (32, 128), so the scatter copied the whole pool in and out on every
    call (Kimi K2.6 decode on v5p). The pool is never read here: a fused read of it was relaid out the same way."""
    n_pages, at_rest = pool.shape[1], (0,) * (pool.ndim - 3)
    page, off, layer = page.astype(jnp.int32), off.astype(jnp.int32), jnp.asarray(layer, jnp.int32)

    def body(i: jax.Array, p: jax.Array) -> jax.Array:
        row = vals[i].reshape((1, 1, 1, *pool.shape[3:]))
        write = lambda p: jax.lax.dynamic_update_slice(p, row, (layer, page[i], off[i], *at_rest))  # noqa: E731
        return jax.lax.cond(page[i] < n_pages, write, lambda p: p, p)

    return jax.lax.fori_loop(0, vals.shape[0], body, pool)


def _store_page_rows(pool: jax.Array, layer: jax.Array, page: jax.Array, off: jax.Array, vals: jax.Array
                     ) -> jax.Array:
    """`_store` of one value per token and head (GQA FP8 scales: pool [L, P, ps, Hkv] f32, vals [N, Hkv]) as whole
    page rows: each token's page row [ps, Hkv] is read, every new value of that page merged into it, and the row
    written back (all tokens of a page write the same merged row; a page past the pool is dropped). The scatter's
    window is then a page's whole row, which XLA:TPU writes in place in the pool's [L, Hkv, P, ps] layout
    (`sharding.pool_format`); its per-element scatter wanted the pages minor and relaid both scale pools out
    around every layer's write (GLM-4.5 decode, v5p and v6e: 8 copies of a 12.6 MB scale pool per step at 2
    layers)."""
    n = page.shape[0]
    if n == 0:
        return pool
    order = jnp.argsort(page, stable=True)  # the tokens of one page side by side
    page, off, vals = page[order], off[order], vals[order].astype(pool.dtype)
    new = jnp.concatenate([jnp.ones((1,), jnp.bool_), page[1:] != page[:-1]])
    first = jax.lax.cummax(jnp.where(new, jnp.arange(n, dtype=jnp.int32), 0))  # its page's first token
    rows = pool[layer, jnp.minimum(page, pool.shape[1] - 1)]  # [N, ps, Hkv]: the pages' rows as stored
    rows = rows.at[first, off].set(vals)  # every new value of a page into its first token's row
    return pool.at[layer, page].set(rows[first], mode="drop")


@functools.partial(jax.jit, static_argnames=("rowwise",))
def write_tokens(pages: KVPages, layer: int | jax.Array, rows: jax.Array | tuple[jax.Array, jax.Array],
                 slot_mapping: jax.Array, slot_tags: jax.Array | None = None, *, rowwise: bool = False) -> KVPages:
    """Scatter N new tokens of one layer into the pool, quantizing if the pool is FP8.

    rows: MLA [N, latent_dim] float; GQA (k [N, kv_heads, head_dim], v [N, kv_heads, head_dim]) float.
    slot_mapping: [N] int32, `page * page_size + offset`; -1 (any negative) is padding and writes nothing.
    Slots past the pool are dropped too. Two rows with the same slot: one of them wins (unspecified).
    slot_tags: [N] uint32, the writer's tag for each slot's page, stamped into `pages.tags` by the same scatter
    (None: tags unchanged). rowwise (the TPU programs): MLA rows by one dynamic_update_slice each (`_store_rows`),
    GQA's FP8 scales as whole page rows (`_store_page_rows`), not by an element scatter.
    """
    lay = pages.layout
    page, off = _slot_indices(slot_mapping, pages.num_pages, lay.page_size)
    tags = stamp_tags(pages.tags, page, slot_tags)  # integrity witness: see the module docstring
    fp8 = lay.dtype == "fp8"
    if lay.kind == "mla":
        if fp8:  # replace(): the pool's other fields (DSA indexer keys) pass through
            q, s = quantize_fp8(rows)
            return replace(pages, latent=_store(pages.latent, layer, page, off, q, lay, rowwise),
                           latent_scale=_store(pages.latent_scale, layer, page, off, s, None, rowwise), tags=tags)
        return replace(pages, latent=_store(pages.latent, layer, page, off, rows, lay, rowwise), tags=tags)
    k_rows, v_rows = rows
    if fp8:
        kq, ks = quantize_fp8(k_rows)
        vq, vs = quantize_fp8(v_rows)
        scales = _store_page_rows if rowwise else _store
        return KVPages(lay, k=_store(pages.k, layer, page, off, kq, lay), v=_store(pages.v, layer, page, off, vq, lay),
                       k_scale=scales(pages.k_scale, layer, page, off, ks),
                       v_scale=scales(pages.v_scale, layer, page, off, vs), tags=tags)
    return KVPages(lay, k=_store(pages.k, layer, page, off, k_rows, lay),
                   v=_store(pages.v, layer, page, off, v_rows, lay), tags=tags)


def stamp_tags(tags: jax.Array | None, page: jax.Array, page_tags: jax.Array | None) -> jax.Array | None:
    """tags [P] uint32 with tags[page[i]] = page_tags[i] for each i; page [N] int32 (out of range: dropped, as
    `_slot_indices` maps padding), page_tags [N] uint32. Either None: tags unchanged."""
    if tags is None or page_tags is None:
        return tags
    return tags.at[page].set(page_tags.astype(tags.dtype), mode="drop")


def _gather(pool: jax.Array, scale: jax.Array | None, block_table: jax.Array, max_len: int,
            out_dtype: jnp.dtype, layout: KVLayout) -> jax.Array:
    """pool [P, ps, ...] bits (one layer), block_table [B, M] -> [B, max_len, ...] out_dtype."""
    b, m = block_table.shape
    x = from_bits(pool[block_table], layout)  # gather the bits, then view only the gathered rows as values
    x = x.astype(jnp.float32)
    if scale is not None:
        x = x * scale[block_table][..., None]
    x = x.reshape(b, m * pool.shape[1], *pool.shape[2:])
    return x[:, :max_len].astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("max_len", "out_dtype"))
def gather_tokens(pages: KVPages, layer: int | jax.Array, block_table: jax.Array, max_len: int | None = None,
                  out_dtype: jnp.dtype = jnp.float32) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Dense, dequantized context of one layer through the block table.

    block_table: [B, max_pages] int32, valid page ids (pad with NULL_PAGE).
    max_len: static; output length, <= max_pages * page_size (default: all of it).
    Returns MLA [B, max_len, latent_dim] out_dtype; GQA (k, v) each [B, max_len, kv_heads, head_dim].
    Positions past a sequence's length hold whatever the page holds: the caller masks them.
    """
    lay = pages.layout
    total = block_table.shape[1] * lay.page_size
    max_len = total if max_len is None else max_len
    if not 0 < max_len <= total:
        raise ConfigError(f"max_len must be in (0, {total}]", value=max_len, param="max_len")
    bt = block_table.astype(jnp.int32)
    if lay.kind == "mla":
        sc = None if pages.latent_scale is None else pages.latent_scale[layer]
        return _gather(pages.latent[layer], sc, bt, max_len, out_dtype, lay)
    ks = None if pages.k_scale is None else pages.k_scale[layer]
    vs = None if pages.v_scale is None else pages.v_scale[layer]
    return (_gather(pages.k[layer], ks, bt, max_len, out_dtype, lay),
            _gather(pages.v[layer], vs, bt, max_len, out_dtype, lay))


@functools.partial(jax.jit, static_argnames=("index_dtype",))
def pages_to_fp8(src: KVPages, page_ids: jax.Array, index_dtype: KVDtype | None = None) -> KVPages:
    """Prefill -> decode hand-off, step 1 (on the prefill device): quantize selected BF16 pages, all layers.

    src: BF16 pool; page_ids [n] int32 (valid ids). Returns a compact FP8 KVPages holding just those n pages
    (half the bytes to transfer), to be placed with `insert_pages` on the decode side. Only the n selected pages
    are turned into values and quantized; the pool is read as bits. DSA indexer keys become FP8 too, or stay
    BF16 with `index_dtype="bf16"` (the decode layout's `index_dtype`).
    """
    lay = src.layout
    if lay.dtype != "bf16":
        raise ConfigError("pages_to_fp8 expects a BF16 pool", value=lay.dtype, param="dtype")
    out = replace(lay, dtype="fp8", index_dtype=None if index_dtype in (None, "fp8") else index_dtype)
    quant = lambda x: quantize_fp8(from_bits(x[:, page_ids], lay))  # noqa: E731
    tags = None if src.tags is None else src.tags[page_ids]  # the source pages' tags travel with them
    if lay.kind == "mla":
        q, s = quant(src.latent)
        return KVPages.from_values(out, latent=q, latent_scale=s, tags=tags, **_index_to(src, page_ids, out))
    (kq, ks), (vq, vs) = quant(src.k), quant(src.v)
    return KVPages.from_values(out, k=kq, v=vq, k_scale=ks, v_scale=vs, tags=tags)


@functools.partial(jax.jit, static_argnames=("dma",))
def insert_pages(dst: KVPages, chunk: KVPages, dst_page_ids: jax.Array, expected_src_tags: jax.Array | None = None,
                 dst_tags: jax.Array | None = None, groups: jax.Array | None = None, *,
                 dma: str | None = None) -> KVPages:
    """Prefill -> decode hand-off, step 2 (on the decode device): write chunk's n pages at dst_page_ids [n] int32.

    Layouts must match (same dtype). A negative dst page id is padding and writes nothing. Bits are copied as
    bits (an integer scatter: no conversion of the pool).

    Integrity (both given, and the pools carry tags): expected_src_tags [n] uint32 are the host's tags of the
    source pages, compared here, on the decode side, with the tags the chunk carried over (live entries only:
    dst id >= 0). Match: the pages are written and dst_tags [n] uint32 (their decode-pool tags) stamped. Any
    mismatch: no page of its group is written and the group's destination tags are stamped 0, so the owner's first
    decode check fails closed (no host round trip here). groups [n] int32 in [0, n): the request each page belongs
    to, so one hand-off can carry several requests and a mismatch fails only its own (None: one group).

    dma "tpu" (one device's pool: in a shard_map, `models.sharded.import_fn`) or "interpret" (the same, in TPU
    interpret mode: tests): the value pages (latent, k, v, indexer keys) are DMA'd in place by `copy_pages_tpu`;
    XLA:TPU's scatter relaid out a whole 8-bit pool around the write. Scales and tags scatter as with None.
    """
    if dst.layout != chunk.layout:
        raise ConfigError("insert_pages: chunk layout differs from the pool's", value=(chunk.layout, dst.layout),
                          param="chunk")
    ids = dst_page_ids.astype(jnp.int32)
    live = ids >= 0
    ids = jnp.where(live, ids, dst.num_pages)  # out of bounds -> dropped
    tags = dst.tags
    if tags is not None and chunk.tags is not None and expected_src_tags is not None and dst_tags is not None:
        bad = live & (chunk.tags != expected_src_tags.astype(chunk.tags.dtype))
        group = jnp.zeros_like(ids) if groups is None else groups.astype(jnp.int32)
        ok = ~jax.ops.segment_max(bad.astype(jnp.int32), group, num_segments=ids.shape[0]).astype(bool)[group]
        tags = stamp_tags(tags, ids, jnp.where(ok, dst_tags.astype(tags.dtype), 0))
        ids = jnp.where(ok, ids, dst.num_pages)  # a failed chunk writes no KV
    put = lambda pool, c: None if pool is None else pool.at[:, ids].set(c, mode="drop")  # noqa: E731
    interpret = pltpu.InterpretParams() if dma == "interpret" else False
    dma_put = lambda pool, c: None if pool is None else copy_pages_tpu(pool, c, ids, interpret=interpret)  # noqa: E731
    copy = put if dma is None else dma_put
    kv = copy if dma is None else lambda pool, c: None if pool is None else _dma_head_major(pool, c, ids, interpret)  # noqa: E731
    sc = put if dma is None else lambda pool, c: None if pool is None else _dma_scale_rows(pool, c, ids, interpret)  # noqa: E731
    return KVPages(dst.layout, latent=copy(dst.latent, chunk.latent), latent_scale=put(dst.latent_scale,
                   chunk.latent_scale), k=kv(dst.k, chunk.k), v=kv(dst.v, chunk.v),
                   k_scale=sc(dst.k_scale, chunk.k_scale), v_scale=sc(dst.v_scale, chunk.v_scale), tags=tags,
                   index_k=copy(dst.index_k, chunk.index_k),
                   index_k_scale=put(dst.index_k_scale, chunk.index_k_scale))


def _dma_head_major(pool: jax.Array, chunk: jax.Array, ids: jax.Array, interpret) -> jax.Array:  # noqa: ANN001
    """`copy_pages_tpu` of GQA K / V pages [L, P, ps, Hkv, D] through their head-major view [L, P, Hkv * ps, D] (the
    TPU pool's layout, `sharding.pool_format`: free there); handed [L, P, ps, Hkv, D], Mosaic wanted it row-major
    and XLA:TPU copied the whole K and V pools in and out (GLM-4.5 import on v5p)."""
    lead, hkv = pool.shape[:2], pool.shape[3]
    out = copy_pages_tpu(head_major(pool), head_major(chunk), ids, interpret=interpret)
    return jnp.swapaxes(out.reshape(*lead, hkv, pool.shape[2], pool.shape[4]), 2, 3)


def _dma_scale_rows(pool: jax.Array, chunk: jax.Array, ids: jax.Array, interpret) -> jax.Array:  # noqa: ANN001
    """`copy_pages_tpu` of GQA scale pages [L, P, ps, Hkv] f32 through their [L * Hkv, P, ps] rows (the TPU pool's
    [L, Hkv, P, ps] layout: free there); their scatter relaid the scale pools out."""
    rows = lambda x: scale_rows(x).reshape(-1, *x.shape[1:3])  # noqa: E731
    out = copy_pages_tpu(rows(pool), rows(chunk), ids, interpret=interpret)
    return jnp.transpose(out.reshape(pool.shape[0], pool.shape[3], *pool.shape[1:3]), (0, 2, 3, 1))


def _index_to(src: KVPages, page_ids: jax.Array, out: KVLayout) -> dict[str, jax.Array | None]:
    """The hand-off of the DSA indexer keys of pages `page_ids`: quantized when `out` stores them as FP8."""
    if src.index_k is None:
        return {}
    keys = src.index_k[:, page_ids]
    if out.index_layout.dtype == src.layout.index_layout.dtype:
        scale = None if src.index_k_scale is None else src.index_k_scale[:, page_ids]
        return {"index_k": keys, "index_k_scale": scale}
    q, s = quantize_fp8(from_bits(keys, src.layout.index_layout))
    return {"index_k": q, "index_k_scale": s}


def convert_pages_to_fp8(src: KVPages, dst: KVPages, src_page_ids: jax.Array, dst_page_ids: jax.Array) -> KVPages:
    """Both hand-off steps on one device: quantize src's BF16 pages and write them into the FP8 pool dst."""
    return insert_pages(dst, pages_to_fp8(src, src_page_ids, dst.layout.index_dtype), dst_page_ids)


# ---- DSA indexer keys and sparse reads ---------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("rowwise",))
def write_index_keys(pages: KVPages, index_layer: int | jax.Array, keys: jax.Array, slot_mapping: jax.Array,
                     slot_tags: jax.Array | None = None, *, rowwise: bool = False) -> KVPages:
    """Scatter N tokens' DSA indexer keys of one indexer layer, quantizing when the keys are FP8.

    keys [N, index_head_dim] float; slot_mapping [N] int32, slot_tags [N] uint32 | None and rowwise (the TPU
    decode) as in `write_tokens` (negative slot: padding, writes nothing; the writer's tag is stamped for each
    written page).
    """
    il = pages.layout.index_layout
    page, off = _slot_indices(slot_mapping, pages.num_pages, il.page_size)
    tags = stamp_tags(pages.tags, page, slot_tags)
    if il.dtype == "fp8":
        q, s = quantize_fp8(keys)
        return replace(pages, index_k=_store(pages.index_k, index_layer, page, off, q, il, rowwise),
                       index_k_scale=_store(pages.index_k_scale, index_layer, page, off, s, None, rowwise),
                       tags=tags)
    return replace(pages, index_k=_store(pages.index_k, index_layer, page, off, keys, il, rowwise), tags=tags)


def index_key_rows(pages: KVPages, index_layer: int | jax.Array, block_tables: jax.Array
                   ) -> tuple[jax.Array, jax.Array | None]:
    """The DSA indexer keys of the pages `block_tables` [B, m] int32 names, as stored: (keys [B, m * page_size,
    index_head_dim] in the layout's value dtype, their per-key f32 scales [B, m * page_size] or None). Only those
    pages' bits are read."""
    il = pages.layout.index_layout
    b, m = block_tables.shape
    bt = block_tables.astype(jnp.int32)
    # the layer inside the gather's indices: `index_k[layer]` first made XLA:TPU copy the whole layer per call
    keys = from_bits(pages.index_k[index_layer, bt], il).reshape(b, m * il.page_size, -1)
    if pages.index_k_scale is None:
        return keys, None
    slot = jnp.arange(il.page_size, dtype=jnp.int32)  # by (page, slot) as the latent scales: by page rows XLA:TPU
    return keys, pages.index_k_scale[index_layer, bt[..., None], slot].reshape(b, -1)  # relaid the scales out


def gather_index_keys(pages: KVPages, index_layer: int | jax.Array, block_tables: jax.Array) -> jax.Array:
    """The DSA indexer keys of the pages `block_tables` [B, m] int32 names -> [B, m * page_size, index_head_dim]
    f32 (dequantized). Only those pages' bits are read and converted."""
    keys, scale = index_key_rows(pages, index_layer, block_tables)
    keys = keys.astype(jnp.float32)
    return keys if scale is None else keys * scale[..., None]


def latent_rows(pages: KVPages, layer: int | jax.Array, block_tables: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array | None]:
    """MLA latent rows of given token positions, as stored, read by (page, slot) through the block table.

    block_tables [B, M] int32; positions [B, ...] int32 (token index within the row's sequence, in [0, M * ps))
    -> (bits [B, ..., latent_dim] `layout.storage_dtype`, their per-token f32 scales [B, ...] or None). Only the
    named rows are read.
    """
    lay = pages.layout
    b = block_tables.shape[0]
    flat = positions.reshape(b, -1).astype(jnp.int32)
    page = jnp.take_along_axis(block_tables.astype(jnp.int32), flat // lay.page_size, axis=1)
    off = flat % lay.page_size
    # the layer inside the gather's indices: `latent[layer]` first made XLA:TPU copy the whole layer per call
    x = pages.latent[layer, page, off].reshape(*positions.shape, lay.latent_dim)
    if pages.latent_scale is None:
        return x, None
    return x, pages.latent_scale[layer, page, off].reshape(positions.shape)


def gather_latent_rows(pages: KVPages, layer: int | jax.Array, block_tables: jax.Array, positions: jax.Array
                       ) -> jax.Array:
    """`latent_rows` dequantized: [B, ..., latent_dim] f32."""
    bits, scale = latent_rows(pages, layer, block_tables, positions)
    x = from_bits(bits, pages.layout).astype(jnp.float32)
    return x if scale is None else x * scale[..., None]


@functools.partial(jax.jit, donate_argnums=0)
def scatter_tags(device_tags: jax.Array, pages: jax.Array, tags: jax.Array) -> jax.Array:
    """device_tags [num_pages] uint32 (donated) with device_tags[pages[i]] = tags[i]; pages [n] int32 (out of range:
    dropped, the padding of a power-of-two update), tags [n] uint32."""
    return device_tags.at[pages].set(tags, mode="drop")


def compile_tag_sync(device_tags: jax.Array, sizes: Sequence[int]) -> None:
    """Compile the tag scatter of `PageAllocator.sync_device_tags` for these (power-of-two) update lengths, on a
    scratch array shaped and placed like `device_tags` [num_pages] uint32: nothing live is touched."""
    num_pages = device_tags.shape[0]
    scratch = jax.device_put(np.zeros(device_tags.shape, np.uint32), device_tags.sharding)
    for n in sizes:  # each scatter donates its input: the next one takes its output, placed alike
        scratch = scatter_tags(scratch, *jax.device_put((np.full(n, num_pages, np.int32), np.zeros(n, np.uint32))))
