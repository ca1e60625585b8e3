"""GLM-5.x DeepSeek Sparse Attention over a paged KV cache: the indexer's top-k over the cached indexer keys, and
attention over only the selected tokens' latent rows (read by (page, slot)).

Selection: each query keeps the `index_topk` causal keys with the highest index score (`attention.index_scores`),
computed blockwise over the row's pages (a running top-k merged with each block's scores), so memory grows with
`index_topk + block`, not with the context. Ties go to the earlier token, as one `lax.top_k` over the whole row.
A selection is (positions [B, T, K] int32 token indices within the row, valid [B, T, K] bool): slots a short
context cannot fill are invalid and masked out of the softmax. IndexShare ("shared") layers reuse the selection of
the last full layer before them.

When a program's whole block table spans at most `index_topk` tokens every query's context fits in its top-k, so
the selection is every causal key and DSA is dense attention: callers then keep their dense path (static: the
block-table width is a compile-time shape) and only write the indexer keys.

Shapes: B rows, T queries per row, M pages per row, ps page size, K index_topk, nh/hd indexer heads/head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.cache import KVPages, gather_index_keys, gather_latent_rows
from jaxserve.models.attention import index_scores

Selection = tuple[jax.Array, jax.Array]  # (positions [B, T, K] int32, valid [B, T, K] bool)
BLOCK_TOKENS = 2048  # keys scored per step of the blockwise top-k (bounds the [B, T, nh, block] scores)


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


def select_topk(q: jax.Array, w: jax.Array, pages: KVPages, index_layer: int, block_tables: jax.Array,
                positions: jax.Array, ctx_lens: jax.Array, topk: int, *, block_tokens: int = BLOCK_TOKENS
                ) -> Selection:
    """The top-`topk` cached keys of each query, by index score, blockwise over the row's pages.

    q [B, T, nh, hd] f32, w [B, T, nh] f32 (`Indexer.query`); block_tables [B, M] int32; positions [B, T] int32
    (each query's absolute position: it may see keys at positions <= its own); ctx_lens [B] int32 (cached tokens
    of the row, this step's included: keys at or past it are never selected). -> Selection, K = topk.
    """
    B, T = q.shape[:2]
    M = block_tables.shape[1]
    ps = pages.layout.page_size
    pb = block_pages(M, ps, block_tokens)
    nb, sb = M // pb, pb * ps
    blocks = block_tables.reshape(B, nb, pb).transpose(1, 0, 2)  # [nb, B, pb]

    def step(carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, jax.Array]
             ) -> tuple[tuple[jax.Array, jax.Array], None]:
        vals, idx = carry
        j, bt = xs
        kpos = j * sb + jnp.arange(sb, dtype=jnp.int32)
        allowed = (kpos[None, None, :] <= positions[:, :, None]) & (kpos[None, None, :] < ctx_lens[:, None, None])
        s = jnp.where(allowed, index_scores(q, w, gather_index_keys(pages, index_layer, bt)), -jnp.inf)
        # running top-k first: among equal scores the earlier token wins, as in one top_k over the whole row
        cat_v = jnp.concatenate([vals, s], axis=-1)
        cat_i = jnp.concatenate([idx, jnp.broadcast_to(kpos, (B, T, sb))], axis=-1)
        vals, at = jax.lax.top_k(cat_v, topk)
        return (vals, jnp.take_along_axis(cat_i, at, axis=-1)), None

    init = (jnp.full((B, T, topk), -jnp.inf, jnp.float32), jnp.zeros((B, T, topk), jnp.int32))
    (vals, idx), _ = jax.lax.scan(step, init, (jnp.arange(nb, dtype=jnp.int32), blocks))
    return idx, vals > -jnp.inf


def sparse_rows(pages: KVPages, layer: int, block_tables: jax.Array, sel: Selection) -> jax.Array:
    """The selected tokens' latent rows of one layer: [B, T, K, r + dr] f32; invalid slots are zeros (they read
    position 0 of the row's first page, whatever it holds, and are masked out of the softmax as well)."""
    idx, valid = sel
    rows = gather_latent_rows(pages, layer, block_tables, jnp.where(valid, idx, 0))
    return jnp.where(valid[..., None], rows, 0.0)
