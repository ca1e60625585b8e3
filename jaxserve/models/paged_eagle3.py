"""The EAGLE-3 draft over the paged KV cache (`jaxserve.models.eagle3` for the math).

The draft's K/V live in the target's pool, in `pool_layers` extra layers after the target's (`cfg.kv_layers` on):
the draft is Llama GQA whatever the target's attention is, so each token's K and V (2 * Nkv * d values) are packed
into those layers' rows (an MLA pool's latent rows, or a GQA pool's k and v rows), zero-padded, and unpacked on
read. Position p's draft row is written at p's slot, so pages, tags (each write stamps the row's tag; the tag check
of the same program covers the reads), the prefix cache and the prefill -> decode hand-off (every pool layer is
copied) cover it unchanged, as the MTP layer (`paged_mtp`). Attention reads the row's context back through its
block table (`gather_tokens`) and attends densely: the paged kernels know only the target's layouts.
`eagle3_extend` writes a chunk's rows (after the target's prefill / verify of the chunk, whose aux hidden states it
takes); `eagle3_step` chains one more draft.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.cache import KVLayout, KVPages, gather_tokens, write_tokens
from jaxserve.models.eagle3 import Eagle3Config, Eagle3Draft, attend
from jaxserve.models.paged import DecodeBatch, PrefillBatch, guard_decode, guard_prefill
from jaxserve.models.transformer import CausalLM


def _row_width(layout: KVLayout) -> int:
    """Values one pool layer holds per token: an MLA latent row, or a GQA k row (and as many in its v row)."""
    return layout.latent_dim if layout.kind == "mla" else layout.kv_heads * layout.head_dim


def pool_layers(cfg: Eagle3Config, layout: KVLayout) -> int:
    """Extra pool layers the draft's K/V take in `layout` (MLA: K and V in one row; GQA: K in k, V in v)."""
    need = cfg.num_kv_heads * cfg.head_dim * (2 if layout.kind == "mla" else 1)
    return -(-need // _row_width(layout))


def _chunks(x: jax.Array, n: int, w: int) -> list[jax.Array]:
    """x [N, D] zero-padded to n * w and cut into n [N, w] pieces."""
    x = jnp.pad(x, ((0, 0), (0, n * w - x.shape[1])))
    return [x[:, j * w:(j + 1) * w] for j in range(n)]


def write_draft_kv(pages: KVPages, base: int, cfg: Eagle3Config, k: jax.Array, v: jax.Array, slots: jax.Array,
                   slot_tags: jax.Array | None) -> KVPages:
    """Write N tokens' draft k, v [N, Nkv, d] at slots [N] (-1: nothing) into pool layers base.. (packed)."""
    lay = pages.layout
    n, w, N = pool_layers(cfg, lay), _row_width(lay), k.shape[0]
    if lay.kind == "mla":
        for j, rows in enumerate(_chunks(jnp.concatenate([k.reshape(N, -1), v.reshape(N, -1)], 1), n, w)):
            pages = write_tokens(pages, base + j, rows, slots, slot_tags)
        return pages
    shape = (N, lay.kv_heads, lay.head_dim)
    for j, (kr, vr) in enumerate(zip(_chunks(k.reshape(N, -1), n, w), _chunks(v.reshape(N, -1), n, w))):
        pages = write_tokens(pages, base + j, (kr.reshape(shape), vr.reshape(shape)), slots, slot_tags)
    return pages


def read_draft_kv(pages: KVPages, base: int, cfg: Eagle3Config, block_tables: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """The draft's k, v [B, S, Nkv, d] f32 (S = the table's pages * page size) through block_tables [B, M]."""
    lay = pages.layout
    n, kvd = pool_layers(cfg, lay), cfg.num_kv_heads * cfg.head_dim
    rows = [gather_tokens(pages, base + j, block_tables) for j in range(n)]
    B, S = block_tables.shape[0], block_tables.shape[1] * lay.page_size
    if lay.kind == "mla":
        flat = jnp.concatenate(rows, -1)
        k, v = flat[..., :kvd], flat[..., kvd:2 * kvd]
    else:
        k = jnp.concatenate([r[0].reshape(B, S, -1) for r in rows], -1)[..., :kvd]
        v = jnp.concatenate([r[1].reshape(B, S, -1) for r in rows], -1)[..., :kvd]
    shape = (B, S, cfg.num_kv_heads, cfg.head_dim)
    return k.reshape(shape), v.reshape(shape)


def _embed(model: CausalLM, draft: Eagle3Draft, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> embeddings [B, T, H] (the draft's own table, or the target's)."""
    return model.embed_tokens(tokens) if draft.embed is None else jnp.take(draft.embed[...], tokens, axis=0)


def _draft_layer(model: CausalLM, draft: Eagle3Draft, pages: KVPages, hidden: jax.Array, tokens: jax.Array,
                 positions: jax.Array, slots: jax.Array, block_tables: jax.Array, ctx_lens: jax.Array,
                 slot_tags: jax.Array | None) -> tuple[jax.Array, KVPages]:
    """The draft rows of positions [B, T] from hidden [B, T, H] and the next tokens [B, T]: writes their K/V at
    slots [B, T], attends over the row's draft rows at positions <= each one's (< ctx_lens [B]).
    -> (h [B, T, H], pages)."""
    B, T = tokens.shape
    base, cfg = model.cfg.kv_layers, draft.cfg
    x, residual = draft.layer_input(_embed(model, draft, tokens), hidden)
    cos, sin = draft.rope(positions)
    q, k, v = draft.qkv(x, cos, sin)
    pages = write_draft_kv(pages, base, cfg, k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:]),
                           slots.reshape(-1), slot_tags)
    kc, vc = read_draft_kv(pages, base, cfg, block_tables)
    kpos = jnp.arange(kc.shape[1], dtype=jnp.int32)
    mask = (kpos[None, None, :] <= positions[:, :, None]) & (kpos[None, None, :] < ctx_lens[:, None, None])
    return draft.finish(attend(q, kc, vc, mask), residual), pages


def eagle3_extend(model: CausalLM, draft: Eagle3Draft, pages: KVPages, batch: PrefillBatch, aux: jax.Array,
                  next_tokens: jax.Array, *, integrity: bool = True) -> tuple[jax.Array, KVPages]:
    """The draft rows of a chunk: row t at `batch.positions[:, t]` takes aux[:, t] (the target's aux hidden
    states there, `prefill(..., aux_layers=...)`) and next_tokens[:, t] (the token at position + 1); writes at
    `batch.slots` after the tag check (a failed row writes nothing; its outputs are meaningless).
    aux [B, T, 3 Ht], next_tokens [B, T] int32 -> (h [B, T, H]: `draft.top1(h)` is the token at position + 2, and
    the next chained step's hidden; pages)."""
    batch, ok, slot_tags = guard_prefill(pages, batch, integrity, model.parallel)
    return _draft_layer(model, draft, pages, draft.project(aux), next_tokens, batch.positions, batch.slots,
                        batch.block_tables, batch.ctx_lens, slot_tags)


def eagle3_step(model: CausalLM, draft: Eagle3Draft, pages: KVPages, batch: DecodeBatch, hidden: jax.Array, *,
                integrity: bool = True) -> tuple[jax.Array, KVPages]:
    """One chained draft step per row: the draft row at `batch.positions` (p) from hidden [B, H] (the previous
    draft row's h) and `batch.tokens` (the token at p + 1: the last draft); writes at `batch.slots` and attends over
    `batch.lengths` (p + 1) rows. -> (h [B, H], pages)."""
    batch, ok, slot_tags = guard_decode(pages, batch, integrity, model.parallel)
    h, pages = _draft_layer(model, draft, pages, hidden[:, None], batch.tokens[:, None], batch.positions[:, None],
                            batch.slots[:, None], batch.block_tables, batch.lengths, slot_tags)
    return h[:, 0], pages
