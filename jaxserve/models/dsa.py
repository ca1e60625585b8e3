"""GLM-5.x DeepSeek Sparse Attention over a paged KV cache: the indexer's top-k over the cached indexer keys, and
attention over only the selected tokens' latent rows (read by (page, slot)).

Selection: each query keeps the `index_topk` causal keys with the highest index score (`attention.index_scores`;
`block_scores`: keys in their stored precision, scales on the products; in decode under attention="pallas" the
Triton kernel `dsa_index_scores`, under "pallas_tpu" the Mosaic `dsa_index_scores_tpu` (page DMAs), reading the
keys in place from the whole pool), computed blockwise over the row's
pages (a running top-k merged with each block's scores), so memory grows with `index_topk + block`, not with the
context. Ties go to the earlier token, as one `lax.top_k` over the whole row.
A selection is (positions [B, T, K] int32 token indices within the row, valid [B, T, K] bool): slots a short
context cannot fill are invalid and masked out of the softmax. IndexShare ("shared") layers reuse the selection of
the last full layer before them.

Attention (`sparse_attention`): in decode (one query per row) under attention="pallas" the Triton kernel
`sparse_mla_decode`, under "pallas_tpu" the Mosaic kernel `sparse_mla_decode_tpu` (row DMAs), read the selected
rows in place from the whole FP8/BF16 pool (no [B, K, r + dr] gather); otherwise XLA gathers them as stored (FP8 /
BF16 bits) and attends, widening them in the dots' operands. Per shard on a mesh, inside one shard_map with the
selection (no collective), and blockwise over queries (`QUERY_BLOCK` at a time: selection, gathered rows and
attention), so a prefill chunk never holds every query's K gathered latent rows at once.

When a program's whole block table spans at most `index_topk` tokens every query's context fits in its top-k, so
the selection is every causal key and DSA is dense attention: callers then keep their dense path (static: the
block-table width is a compile-time shape) and only write the indexer keys.

Shapes: B rows, T queries per row, M pages per row, ps page size, K index_topk, nh/hd indexer heads/head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.cache import KVLayout, KVPages
from jaxserve.cache.pool import from_bits, index_key_rows, latent_rows
from jaxserve.models import sharded
from jaxserve.models.attention import masked_softmax
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.sharding import POOL_AXES, Parallel
from pallas_kernels.dsa_index_scores import dsa_index_scores
from pallas_kernels.dsa_index_scores_tpu import dsa_index_scores_tpu
from pallas_kernels.sparse_mla_decode import sparse_mla_decode
from pallas_kernels.sparse_mla_decode_tpu import sparse_mla_decode_tpu

Selection = tuple[jax.Array, jax.Array]  # (positions [B, T, K] int32, valid [B, T, K] bool)
BLOCK_TOKENS = 2048  # keys scored per step of the blockwise top-k (bounds the [B, T, nh, block] scores)
QUERY_BLOCK = 16  # queries per step of sparse prefill (bounds the gathered rows at [B, 16, K, r + dr])
_POOLS = ("latent", "latent_scale", "index_k", "index_k_scale")  # the pool arrays DSA reads (all layers)


def is_sparse(num_tokens: int, index_topk: int) -> bool:
    """Whether a block table of `num_tokens` token slots needs the sparse path (static)."""
    return num_tokens > index_topk


def block_pages(num_pages: int, page_size: int, block_tokens: int = BLOCK_TOKENS) -> int:
    """Pages per scoring block: the largest power of two dividing `num_pages` with at most `block_tokens` tokens
    (at least one page)."""
    b = 1
    while num_pages % (2 * b) == 0 and 2 * b * page_size <= block_tokens:
        b *= 2
    return b


def block_scores(q: jax.Array, w: jax.Array, pages: KVPages, index_layer: int, block_tables: jax.Array
                 ) -> jax.Array:
    """`attention.index_scores` of the cached indexer keys of the pages `block_tables` [B, m] names, the keys read
    in their stored precision and widened only as the dot's operand (which XLA fuses into the dot), an FP8 key's
    per-key scale applied to its f32 products rather than to every element. q [B, T, nh, hd] f32, w [B, T, nh]
    f32 -> [B, T, m * ps] f32 (unmasked)."""
    keys, scale = index_key_rows(pages, index_layer, block_tables)
    s = jnp.einsum("btnd,bsd->btns", q, keys.astype(jnp.float32), preferred_element_type=jnp.float32)
    if scale is not None:
        s = s * scale[:, None, None, :]
    return jnp.einsum("btn,btns->bts", w, jax.nn.relu(s * q.shape[-1] ** -0.5))


def kernel_scores(q: jax.Array, w: jax.Array, pages: KVPages, index_layer: int, block_tables: jax.Array, *,
                  attention: AttentionBackend) -> jax.Array:
    """`block_scores` of one query per row by the scores kernel of `attention`'s tiling (Triton, or Mosaic for
    "pallas_tpu"), over the whole index-key pool's bits (no gathered keys, no per-head scores in HBM).
    q [B, 1, nh, hd] f32, w [B, 1, nh] f32 -> [B, 1, m * ps] f32 (unmasked)."""
    interpret = attention.interpret
    if attention.tiling == "tpu":
        return dsa_index_scores_tpu(q[:, 0], w[:, 0], pages.index_k, block_tables, pages.index_k_scale,
                                    layer=index_layer, interpret=interpret)
    s = dsa_index_scores(q[:, 0], w[:, 0], pages.index_k, block_tables, pages.index_k_scale, layer=index_layer,
                         value_dtype=pages.layout.index_layout.jnp_dtype, interpret=interpret)
    return s[:, None]


def select_topk(q: jax.Array, w: jax.Array, pages: KVPages, index_layer: int, block_tables: jax.Array,
                positions: jax.Array, ctx_lens: jax.Array, topk: int, *, block_tokens: int | None = None,
                attention: AttentionBackend = AttentionBackend()) -> Selection:
    """The top-`topk` cached keys of each query, by index score, blockwise over the row's pages.

    q [B, T, nh, hd] f32, w [B, T, nh] f32 (`Indexer.query`); block_tables [B, M] int32; positions [B, T] int32
    (each query's absolute position: it may see keys at positions <= its own); ctx_lens [B] int32 (cached tokens
    of the row, this step's included: keys at or past it are never selected). block_tokens: keys per step,
    default BLOCK_TOKENS x (QUERY_BLOCK // T): T x block stays a prefill query block's, so a decode step (T = 1)
    scores up to 16 x more keys at once; a row that fits one step takes one top_k, with no running top-k's
    [B, T, K + block] concatenation. One query per row under attention="pallas" / "pallas_tpu": the scores by
    `kernel_scores`.
    -> Selection, K = topk.
    """
    B, T = q.shape[:2]
    kernel = attention.implementation in ("pallas", "pallas_tpu") and T == 1
    M = block_tables.shape[1]
    ps = pages.layout.page_size
    pb = block_pages(M, ps, block_tokens or BLOCK_TOKENS * max(1, QUERY_BLOCK // T))
    nb, sb = M // pb, pb * ps
    blocks = block_tables.reshape(B, nb, pb).transpose(1, 0, 2)  # [nb, B, pb]

    def scores(j: jax.Array | int, bt: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Block j's key positions [sb] and their causal scores [B, T, sb] (-inf where not allowed)."""
        kpos = j * sb + jnp.arange(sb, dtype=jnp.int32)
        allowed = (kpos[None, None, :] <= positions[:, :, None]) & (kpos[None, None, :] < ctx_lens[:, None, None])
        s = (kernel_scores(q, w, pages, index_layer, bt, attention=attention) if kernel
             else block_scores(q, w, pages, index_layer, bt))
        return kpos, jnp.where(allowed, s, -jnp.inf)

    def step(carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, jax.Array]
             ) -> tuple[tuple[jax.Array, jax.Array], None]:
        vals, idx = carry
        kpos, s = scores(*xs)
        # running top-k first: among equal scores the earlier token wins, as in one top_k over the whole row
        cat_v = jnp.concatenate([vals, s], axis=-1)
        cat_i = jnp.concatenate([idx, jnp.broadcast_to(kpos, (B, T, sb))], axis=-1)
        vals, at = jax.lax.top_k(cat_v, topk)
        return (vals, jnp.take_along_axis(cat_i, at, axis=-1)), None

    if nb == 1:  # one top_k over the whole row (lax.top_k: the earlier token wins a tie)
        vals, idx = jax.lax.top_k(scores(0, block_tables)[1], min(topk, sb))
        pad = topk - vals.shape[-1]  # a row shorter than topk: invalid slots, as the running top-k leaves them
        return (jnp.pad(idx, ((0, 0), (0, 0), (0, pad))),
                jnp.pad(vals > -jnp.inf, ((0, 0), (0, 0), (0, pad))))
    init = (jnp.full((B, T, topk), -jnp.inf, jnp.float32), jnp.zeros((B, T, topk), jnp.int32))
    (vals, idx), _ = jax.lax.scan(step, init, (jnp.arange(nb, dtype=jnp.int32), blocks))
    return idx, vals > -jnp.inf


def sparse_rows(pages: KVPages, layer: int, block_tables: jax.Array, sel: Selection
                ) -> tuple[jax.Array, jax.Array | None]:
    """The selected tokens' latent rows of one layer as stored: (bits [B, T, K, r + dr] `layout.storage_dtype`,
    per-token f32 scales [B, T, K] or None). Invalid slots are zero bits (they read position 0 of the row's first
    page, whatever it holds: a NaN there would survive its masked probability), masked out of the softmax too."""
    idx, valid = sel
    bits, scale = latent_rows(pages, layer, block_tables, jnp.where(valid, idx, 0))
    return jnp.where(valid[..., None], bits, jnp.zeros((), bits.dtype)), scale


def query_block(num_queries: int, limit: int = QUERY_BLOCK) -> int:
    """Queries per step: the largest power of two dividing `num_queries`, at most `limit` (static)."""
    b = 1
    while num_queries % (2 * b) == 0 and 2 * b <= limit:
        b *= 2
    return b


def latent_attention(q: jax.Array, rows: tuple[jax.Array, jax.Array | None], valid: jax.Array, layout: KVLayout, *,
                     softmax_scale: float) -> jax.Array:
    """Absorbed MLA attention of each query over its own selected latent rows: q [B, T, N, r + dr] f32 (absorbed),
    rows `sparse_rows`' (bits [B, T, K, r + dr], scales [B, T, K] f32 | None), valid [B, T, K] bool -> softmax-
    weighted c_kv [B, T, N, r] f32. The stored values are widened inside each dot's operand and an FP8 row's scale
    multiplies its logits and its probabilities, so no f32 copy of the rows is written: dequantized before the
    dots, XLA:TPU wrote the rows in f32 and then relaid them out for the dots (GLM-5.2 v6e decode, 64 rows x 2048:
    377 + 604 MB moved a layer; now the 8-bit rows' relayout, 151 MB)."""
    bits, scale = rows
    c = from_bits(bits, layout).astype(jnp.float32)  # the widening fuses into each dot's operand
    s = jnp.einsum("btnc,btkc->bntk", q, c, preferred_element_type=jnp.float32)
    scale = None if scale is None else scale[:, None]  # [B, 1, T, K], as s's [B, N, T, K]
    if scale is not None:
        s = s * scale
    p = masked_softmax(s * softmax_scale, valid)
    if scale is not None:
        p = p * scale
    return jnp.einsum("bntk,btkr->btnr", p, c[..., :layout.kv_lora_rank], preferred_element_type=jnp.float32)


def kernel_attention(q: jax.Array, pages: KVPages, layer: int, block_tables: jax.Array, sel: Selection, *,
                     softmax_scale: float, attention: AttentionBackend) -> jax.Array:
    """`latent_attention` of one query per row by the sparse decode kernel of `attention`'s tiling (Triton, or
    Mosaic for "pallas_tpu"), over the selected rows of the whole pool's bits (no per-layer slice, no gathered
    copy). q [B, 1, N, r + dr] f32 -> [B, 1, N, r] f32."""
    idx, valid = sel
    lay = pages.layout
    indices = jnp.where(valid[:, 0], idx[:, 0], -1)
    if attention.tiling == "tpu":
        o = sparse_mla_decode_tpu(q[:, 0], pages.latent, block_tables, indices, pages.latent_scale, layer=layer,
                                  kv_lora_rank=lay.kv_lora_rank, softmax_scale=softmax_scale,
                                  interpret=attention.interpret, out_dtype=jnp.float32)
        return o[:, None]
    o = sparse_mla_decode(q[:, 0], pages.latent, block_tables, indices, pages.latent_scale, layer=layer,
                          kv_lora_rank=lay.kv_lora_rank, softmax_scale=softmax_scale, value_dtype=lay.jnp_dtype,
                          interpret=attention.interpret, out_dtype=jnp.float32)
    return o[:, None]


def attend(q: jax.Array, index_q: tuple[jax.Array, jax.Array] | None, prev: Selection | None, pages: KVPages,
           layer: int, index_layer: int, tables: tuple[jax.Array, jax.Array, jax.Array], *, topk: int,
           softmax_scale: float, block: int = QUERY_BLOCK, attention: AttentionBackend = AttentionBackend()
           ) -> tuple[jax.Array, Selection]:
    """One device's DSA attention, blockwise over queries: for each block of at most `block` queries, the top-k
    selection (by `index_q`, the indexer's (q [B, T, nh, hd], w [B, T, nh]) f32; or the block of `prev`, the
    selection an IndexShare layer reuses), its latent rows and absorbed attention over them, so the gathered rows
    are [B, block, K, r + dr], never [B, T, K, r + dr].
    One query per row under attention="pallas" or "pallas_tpu": `kernel_attention` instead of the gather and XLA
    attention.
    q [B, T, N, r + dr] f32 (absorbed); tables (block_tables [B, M], positions [B, T], ctx_lens [B]) int32.
    -> (softmax-weighted c_kv [B, T, N, r] f32, the selection [B, T, K])."""
    bt, positions, ctx_lens = tables
    B, T = q.shape[:2]
    kernel = attention.implementation in ("pallas", "pallas_tpu") and T == 1

    def one(xs: tuple) -> tuple[jax.Array, Selection]:
        qb, iq, sel, pos = xs
        if iq is not None:
            sel = select_topk(iq[0], iq[1], pages, index_layer, bt, pos, ctx_lens, topk, attention=attention)
        if kernel:
            return kernel_attention(qb, pages, layer, bt, sel, softmax_scale=softmax_scale, attention=attention), sel
        return latent_attention(qb, sparse_rows(pages, layer, bt, sel), sel[1], pages.layout,
                                softmax_scale=softmax_scale), sel

    xs = (q, index_q, prev, positions)
    tb = query_block(T, block)
    if tb == T:
        return one(xs)
    split = lambda x: x.reshape(B, T // tb, tb, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
    merge = lambda x: x.swapaxes(0, 1).reshape(B, T, *x.shape[3:])  # noqa: E731
    out = jax.lax.map(one, jax.tree.map(split, xs))
    return jax.tree.map(merge, out)


def sparse_attention(par: Parallel | None, q: jax.Array, index_q: tuple[jax.Array, jax.Array] | None,
                     prev: Selection | None, pages: KVPages, layer: int, index_layer: int,
                     tables: tuple[jax.Array, jax.Array, jax.Array], *, topk: int, softmax_scale: float,
                     attention: AttentionBackend = AttentionBackend()) -> tuple[jax.Array, Selection]:
    """`attend` over the whole pool (every layer: the layer is picked inside the gathers, so no per-layer slice is
    materialized), per shard on a mesh: TP attention splits q's heads and every device scores the indexer's heads
    over the replicated index keys itself (the keys it must read are the same either way, and a split would add
    an all-reduce of [B, T, S] scores before the top-k); DP attention splits rows and pages. No collective.
    Shapes as `attend`."""
    arrays = tuple(getattr(pages, f) for f in _POOLS)

    def body(acts: tuple, pools: tuple, tables: tuple) -> tuple[jax.Array, Selection]:
        local = KVPages(pages.layout, **dict(zip(_POOLS, pools)))
        return attend(*acts, local, layer, index_layer, tables, topk=topk, softmax_scale=softmax_scale,
                      attention=attention)

    if par is None:
        return body((q, index_q, prev), arrays, tables)
    heads, rows = ("batch", None, "heads", None), ("batch",)
    return sharded.paged(par, body, (q, index_q, prev), (heads, rows, rows), arrays, tables,
                         pool_axes=tuple(POOL_AXES[f] for f in _POOLS), out_axes=(heads, rows))
