"""The models over a paged KV cache: chunked prefill (BF16 pages, absorbed MLA, attention block by block over the
pages) and decode (absorbed MLA, FP8 or BF16 pages, integrity check before attention). Pure functions of
(model, pages, batch); the engine jits them.

Shapes: B batch rows, T chunk tokens, M pages per row (block table width), ps page size, L layers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from jaxserve.cache import (KVPages, check_tags, guard_tables, mask_outputs, page_tags_at,
                           write_index_keys, write_tokens)
from jaxserve.models import dsa, sharded
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.decoder import DecoderLayer
from jaxserve.models.transformer import CausalLM
from jaxserve.sharding import Parallel


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PrefillBatch:
    """A chunk of each row's prompt. Rows with chunk_lens 0 are padding.

    tokens [B, T] int32; positions [B, T] int32 (absolute); slots [B, T] int32 (pool slot of each chunk token, -1
    for padding); block_tables [B, M] int32 (the row's pages covering prior context + this chunk);
    ctx_lens [B] int32 (prior tokens + chunk tokens); chunk_lens [B] int32; expected_tags [B, M] uint32 (the
    host's tags of the block table's pages; None: unchecked, e.g. a private pool); num_pages [B] int32 (live
    entries of the block table).
    """

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    ctx_lens: jax.Array
    chunk_lens: jax.Array
    expected_tags: jax.Array | None = None
    num_pages: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class DecodeBatch:
    """One new token per row. Padding rows have lengths 0 and slot -1.

    tokens [B] int32 (the last sampled token, not yet in the cache); positions [B] int32; slots [B] int32;
    block_tables [B, M] int32; lengths [B] int32 (context including this token); expected_tags [B, M] uint32;
    num_pages [B] int32 (live entries of the block table).
    """

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array
    block_tables: jax.Array
    lengths: jax.Array
    expected_tags: jax.Array
    num_pages: jax.Array


def prefill(model: CausalLM, pages: KVPages, batch: PrefillBatch, *, all_logits: bool = False,
            attention: AttentionBackend = AttentionBackend(), integrity: bool = True, return_hidden: bool = False,
            aux_layers: tuple[int, ...] = ()
            ) -> tuple[jax.Array, KVPages, jax.Array] | tuple[jax.Array, KVPages, jax.Array, jax.Array]:
    """Write the chunk's KV into `pages` and attend over the row's whole context read back from the pool.

    Reading the context (this chunk included) from the pool makes the result independent of how a prompt is
    chunked or whether its prefix came from the prefix cache; over an FP8 pool it is exactly what decode reads.
    Attention reads the pool block by block (online softmax) through `attention`: "xla" the blockwise XLA form,
    "pallas*" the flash prefill kernels (GPU or TPU tiling), the XLA form with bf16 dot operands for a bf16 model
    over bf16 / fp8 pages (`prefill_attention_xla.prefill_dot_dtype`); MLA in the absorbed form (MQA over the
    latent pages, no kv_b expansion of the context). GLM-5 DSA layers (`_dsa_prefill_attention`): that absorbed
    form while the block table spans at most index_topk tokens, else absorbed attention over each query's top-k
    selected latent rows.
    With `batch.expected_tags`, the tag check runs first over every page the chunk reads (prefix-cache pages
    included): a failed row reads only the null page, writes nothing and gets zero logits.
    Without all_logits (and return_hidden) the last layer's output projection and MLP run at each row's last chunk
    token only.
    -> (logits at each row's last chunk token [B, V] f32, or at every chunk token [B, T, V] with all_logits;
    pages; ok [B] bool), then with return_hidden the last decoder layer's output at every chunk token [B, T, H]
    (before the final norm: the MTP head's input, `jaxserve.models.paged_mtp`). With aux_layers (ascending layer
    indices; num_layers: the last layer's output) that 4th output is instead the residual stream at the input of
    each, concatenated [B, T, len(aux_layers) * H] (an EAGLE-3 draft's input, `jaxserve.models.paged_eagle3`).
    """
    batch, ok, slot_tags = guard_prefill(pages, batch, integrity, model.parallel)
    cos, sin = model.rope(batch.positions)
    h = model.embed_tokens(batch.tokens)
    selected = None  # GLM-5 DSA: the last full indexer layer's selection, reused by IndexShare layers
    aux = []
    full = all_logits or return_hidden or len(model.layers) in aux_layers
    for i, layer in enumerate(model.layers):
        if i in aux_layers:
            aux.append(h)
        o, pages, selected = prefill_attention(model, i, layer.input_norm(h), pages, batch, cos, sin, selected,
                                               slot_tags, attention)
        if i == len(model.layers) - 1 and not full:
            # the last layer's K/V is written: its output projection and MLP only matter at the sampled token
            h, o = _at_last(h, batch.chunk_lens), _at_last(o, batch.chunk_lens)
        h = h + layer.attn.o(o)
        h = h + layer.mlp(layer.post_norm(h))
    logits = mask_outputs(ok, model.logits(h if all_logits else _at_last(h, batch.chunk_lens)[:, 0]))
    if aux_layers:
        return logits, pages, ok, jnp.concatenate(aux + [h] * (len(model.layers) in aux_layers), axis=-1)
    return (logits, pages, ok, h) if return_hidden else (logits, pages, ok)


def _check_tags(par: Parallel | None, pages: KVPages, block_tables: jax.Array, expected_tags: jax.Array,
                num_pages: jax.Array) -> jax.Array:
    """`cache.check_tags`, per page shard under DP attention (`sharded.check_tags_per_shard`). -> ok [B] bool."""
    if sharded.pages_split(par):
        return sharded.check_tags_per_shard(par, pages.tags, block_tables, expected_tags, num_pages)
    return check_tags(pages.tags, block_tables, expected_tags, num_pages)


def _write(par: Parallel | None, write, pages: KVPages, rows, slots: jax.Array,  # noqa: ANN001
           slot_tags: jax.Array | None) -> KVPages:
    """write(pages, rows, slots, slot_tags) -> pages (a KV row write), per page shard under DP attention."""
    if sharded.pages_split(par):
        return sharded.write_per_shard(par, write, pages, rows, slots, slot_tags)
    return write(pages, rows, slots, slot_tags)


def _rows_of(i: int, rowwise: bool = False, index_slot: int | None = None):  # noqa: ANN202
    """The write of pool layer i's KV rows (or, with index_slot, of its DSA indexer keys) as `_write` calls it."""
    if index_slot is not None:
        return lambda pages, keys, slots, tags: write_index_keys(pages, index_slot, keys, slots, tags, rowwise=rowwise)
    return lambda pages, rows, slots, tags: write_tokens(pages, i, rows, slots, tags, rowwise=rowwise)


def guard_prefill(pages: KVPages, batch: PrefillBatch, integrity: bool, par: Parallel | None = None
                  ) -> tuple[PrefillBatch, jax.Array, jax.Array | None]:
    """The tag check of a prefill chunk (on `par`'s mesh: per page shard under DP attention): -> (the batch with a
    failed row's slots -1 and its table the null page, ok [B] bool, the tags each chunk token's write stamps
    [B * T] uint32 or None when unchecked)."""
    B = batch.tokens.shape[0]
    checked = integrity and batch.expected_tags is not None
    ok = (_check_tags(par, pages, batch.block_tables, batch.expected_tags, batch.num_pages) if checked
          else jnp.ones((B,), jnp.bool_))
    batch = replace(batch, slots=jnp.where(ok[:, None], batch.slots, -1),
                    block_tables=guard_tables(ok, batch.block_tables))
    slot_tags = (page_tags_at(batch.expected_tags, batch.positions, pages.layout.page_size).reshape(-1) if checked
                 else None)
    return batch, ok, slot_tags


def decoder_layer(model: CausalLM, i: int) -> DecoderLayer:
    """Layer i of the pool's layers: a main layer, or the MTP head's layer (i = cfg.num_layers)."""
    return model.layers[i] if i < model.cfg.num_layers else model.mtp.layer


def prefill_attention(model: CausalLM, i: int, x: jax.Array, pages: KVPages, batch: PrefillBatch, cos: jax.Array,
                      sin: jax.Array, selected: dsa.Selection | None, slot_tags: jax.Array | None,
                      attention: AttentionBackend) -> tuple[jax.Array, KVPages, dsa.Selection | None]:
    """Pool layer i's attention for a (guarded) prefill chunk: writes the chunk's KV, attends over the pool.
    x [B, T, H] (normed) -> (o [B, T, N * dv] before the output projection, pages, DSA selection or None)."""
    cfg = model.cfg
    B, T = batch.tokens.shape
    attn = decoder_layer(model, i).attn
    tables = (batch.block_tables, batch.positions, batch.ctx_lens)
    flat_slots = batch.slots.reshape(-1)
    if cfg.has_indexer:
        o, pages, selected = _dsa_prefill_attention(model, i, x, pages, batch, cos, sin, selected, slot_tags,
                                                    attention)
    elif cfg.is_mla:
        q_nope, q_rope, latent, _ = attn.project(x, cos, sin)
        pages = _write(model.parallel, _rows_of(i), pages, latent.reshape(B * T, -1), flat_slots, slot_tags)
        q = attn.absorb_query(q_nope, q_rope)  # [B, T, N, r + dr] f32
        o_lat = attention.prefill(model.parallel, q, pages, i, tables, softmax_scale=cfg.softmax_scale,
                                  act_dtype=x.dtype)
        o = attn.absorb_output(o_lat, x.dtype)
    else:
        q, k, v = attn.project(x, cos, sin)
        # the TPU kernels' FP8 pool (speculative verify): scales by page rows, in place (cache.pool._store_page_rows)
        pages = _write(model.parallel, _rows_of(i, rowwise=attention.tiling == "tpu"), pages,
                       (k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:])), flat_slots, slot_tags)
        o = attention.prefill(model.parallel, q, pages, i, tables, softmax_scale=cfg.softmax_scale,
                              act_dtype=x.dtype)
        o = o.astype(x.dtype)
    return o.reshape(B, T, -1), pages, selected


def _at_last(x: jax.Array, chunk_lens: jax.Array) -> jax.Array:
    """x [B, T, D] -> [B, 1, D]: each row's last chunk token (row 0's position for padding rows)."""
    last = jnp.clip(chunk_lens - 1, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, last[:, None, None], axis=1)


def decode(model: CausalLM, pages: KVPages, batch: DecodeBatch, *, integrity: bool, attention: AttentionBackend,
           return_hidden: bool = False
           ) -> tuple[jax.Array, KVPages, jax.Array] | tuple[jax.Array, KVPages, jax.Array, jax.Array]:
    """One decode step. The tag check (against `pages.tags`, the device's witness) runs first: a failed row writes
    nothing, its block table is the null page before any gather or kernel sees it, its attention output is masked
    to zero, and it is reported. Each write stamps the row's tag of the page it writes.
    -> (logits [B, V] f32, pages, ok [B] bool), then with return_hidden the last decoder layer's output [B, H]
    (before the final norm)."""
    batch, ok, slot_tags = guard_decode(pages, batch, integrity, model.parallel)
    cos, sin = model.rope(batch.positions[:, None])
    h = model.embed_tokens(batch.tokens[:, None])  # [B, 1, H]
    selected = None  # GLM-5 DSA: the last full indexer layer's selection, reused by IndexShare layers
    for i, layer in enumerate(model.layers):
        o, pages, selected = decode_attention(model, i, layer.input_norm(h), pages, batch, ok, cos, sin, selected,
                                              slot_tags, attention)
        h = h + layer.attn.o(o)
        h = h + layer.mlp(layer.post_norm(h))
    logits = model.logits(h[:, 0])
    return (logits, pages, ok, h[:, 0]) if return_hidden else (logits, pages, ok)


def guard_decode(pages: KVPages, batch: DecodeBatch, integrity: bool, par: Parallel | None = None
                 ) -> tuple[DecodeBatch, jax.Array, jax.Array | None]:
    """The tag check of a decode step (on `par`'s mesh: per page shard under DP attention): -> (the batch with a
    failed row's slot -1, length 0 and table the null page, ok [B] bool, the tag each row's write stamps [B] uint32
    or None when unchecked)."""
    ok = (_check_tags(par, pages, batch.block_tables, batch.expected_tags, batch.num_pages) if integrity
          else jnp.ones(batch.slots.shape, jnp.bool_))
    batch = replace(batch, slots=jnp.where(ok, batch.slots, -1), lengths=jnp.where(ok, batch.lengths, 0),
                    block_tables=guard_tables(ok, batch.block_tables))
    slot_tags = page_tags_at(batch.expected_tags, batch.positions, pages.layout.page_size) if integrity else None
    return batch, ok, slot_tags


def decode_attention(model: CausalLM, i: int, x: jax.Array, pages: KVPages, batch: DecodeBatch, ok: jax.Array,
                     cos: jax.Array, sin: jax.Array, selected: dsa.Selection | None, slot_tags: jax.Array | None,
                     attention: AttentionBackend) -> tuple[jax.Array, KVPages, dsa.Selection | None]:
    """Pool layer i's attention for a (guarded) decode step: writes the token's KV, attends over the row's pages; a
    failed row's output is zero. x [B, 1, H] (normed) -> (o [B, 1, N * dv], pages, DSA selection or None)."""
    cfg = model.cfg
    attn = decoder_layer(model, i).attn
    B = x.shape[0]
    if cfg.has_indexer:
        o, pages, selected = _dsa_decode_attention(model, i, x, pages, batch, ok, cos, sin, selected, slot_tags,
                                                   attention)
    elif cfg.is_mla:
        q_nope, q_rope, latent, _ = attn.project(x, cos, sin)
        # the TPU kernel's pool: row writes, in place in its tiling (see cache.pool._store_rows)
        pages = _write(model.parallel, _rows_of(i, rowwise=attention.tiling == "tpu"), pages, latent[:, 0],
                       batch.slots, slot_tags)
        q = attn.absorb_query(q_nope, q_rope)[:, 0]  # [B, N, r + dr] f32
        o_lat = attention.decode(model.parallel, q, pages, i, batch.block_tables, batch.lengths,
                                 softmax_scale=cfg.softmax_scale)
        o = attn.absorb_output(mask_outputs(ok, o_lat)[:, None], x.dtype)
    else:
        q, k, v = attn.project(x, cos, sin)
        pages = _write(model.parallel, _rows_of(i, rowwise=attention.tiling == "tpu"), pages, (k[:, 0], v[:, 0]),
                       batch.slots, slot_tags)
        o = attention.decode(model.parallel, q[:, 0], pages, i, batch.block_tables, batch.lengths,
                             softmax_scale=cfg.softmax_scale)
        o = mask_outputs(ok, o)[:, None].astype(x.dtype)
    return o.reshape(B, 1, -1), pages, selected


def _dsa_prefill_attention(model: CausalLM, i: int, x: jax.Array, pages: KVPages, batch: PrefillBatch,
                           cos: jax.Array, sin: jax.Array, prev: dsa.Selection | None, slot_tags: jax.Array | None,
                           attention: AttentionBackend) -> tuple[jax.Array, KVPages, dsa.Selection | None]:
    """GLM-5 layer i's attention over the pool for a prefill chunk (`batch` already tag-checked: a failed row's
    slots are -1 and its table the null page): writes the chunk's latent rows and (full indexer layers) indexer
    keys, stamping `slot_tags`, then attends densely (MLA's absorbed paged prefill through `attention`) when the
    block table spans <= index_topk tokens, else over each query's top-k selected rows (its own indexer's, or
    `prev` on IndexShare layers); both per shard on a mesh.
    x [B, T, H] -> (o [B, T, N, dv], pages, this layer's selection or None on the dense path)."""
    cfg, attn = model.cfg, decoder_layer(model, i).attn
    B, T = batch.tokens.shape
    bt, flat_slots = batch.block_tables, batch.slots.reshape(-1)
    q_nope, q_rope, latent, q_resid = attn.project(x, cos, sin)
    pages = _write(model.parallel, _rows_of(i), pages, latent.reshape(B * T, -1), flat_slots, slot_tags)
    if attn.indexer is not None:
        pages = _write(model.parallel, _rows_of(i, index_slot=cfg.index_slot(i)), pages,
                       attn.indexer.key(x, cos, sin).reshape(B * T, -1), flat_slots, slot_tags)
    tables = (bt, batch.positions, batch.ctx_lens)
    if not dsa.is_sparse(bt.shape[1] * pages.layout.page_size, cfg.index_topk):
        o_lat = attention.prefill(model.parallel, attn.absorb_query(q_nope, q_rope), pages, i, tables,
                                  softmax_scale=cfg.softmax_scale, act_dtype=x.dtype)
        return attn.absorb_output(o_lat, x.dtype), pages, None
    o, sel = _dsa_sparse(model, i, x, q_nope, q_rope, q_resid, cos, sin, prev, pages, tables)
    return o, pages, sel


def _dsa_decode_attention(model: CausalLM, i: int, x: jax.Array, pages: KVPages, batch: DecodeBatch,
                          ok: jax.Array, cos: jax.Array, sin: jax.Array, prev: dsa.Selection | None,
                          slot_tags: jax.Array | None, attention: AttentionBackend
                          ) -> tuple[jax.Array, KVPages, dsa.Selection | None]:
    """GLM-5 layer i's decode attention (`batch` already tag-checked: a failed row has slot -1, length 0 and the
    null page as its table): writes the new token's latent row and indexer key, stamping `slot_tags`, then the
    dense paged kernel when the block table spans <= index_topk tokens, else absorbed attention over the top-k
    rows of the row's cached tokens; a failed row's output is zeroed.
    x [B, 1, H] -> (o [B, 1, N, dv], pages, selection or None)."""
    cfg, attn = model.cfg, decoder_layer(model, i).attn
    bt, slots, lengths = batch.block_tables, batch.slots, batch.lengths
    q_nope, q_rope, latent, q_resid = attn.project(x, cos, sin)
    rowwise = attention.tiling == "tpu"  # in place in the TPU pool's tiling, as the MLA decode writes
    pages = _write(model.parallel, _rows_of(i, rowwise), pages, latent[:, 0], slots, slot_tags)
    if attn.indexer is not None:
        pages = _write(model.parallel, _rows_of(i, rowwise, cfg.index_slot(i)), pages,
                       attn.indexer.key(x, cos, sin)[:, 0], slots, slot_tags)
    if not dsa.is_sparse(bt.shape[1] * pages.layout.page_size, cfg.index_topk):
        q = attn.absorb_query(q_nope, q_rope)[:, 0]
        o_lat = attention.decode(model.parallel, q, pages, i, bt, lengths, softmax_scale=cfg.softmax_scale)
        return attn.absorb_output(mask_outputs(ok, o_lat)[:, None], x.dtype), pages, None
    o, sel = _dsa_sparse(model, i, x, q_nope, q_rope, q_resid, cos, sin, prev, pages,
                         (bt, batch.positions[:, None], lengths), attention)
    return mask_outputs(ok, o), pages, sel


def _dsa_sparse(model: CausalLM, i: int, x: jax.Array, q_nope: jax.Array, q_rope: jax.Array, q_resid: jax.Array,
                cos: jax.Array, sin: jax.Array, prev: dsa.Selection | None, pages: KVPages, tables: tuple,
                attention: AttentionBackend = AttentionBackend()) -> tuple[jax.Array, dsa.Selection]:
    """GLM-5 layer i's sparse attention (per shard: `dsa.sparse_attention`) over each query's top-k rows, by its
    own indexer or `prev` (IndexShare); one query per row under attention="pallas" by the sparse decode kernel.
    tables: (block_tables [B, M], positions [B, T], ctx_lens [B]) int32.
    x [B, T, H] -> (o [B, T, N, dv] x.dtype, the selection [B, T, K])."""
    cfg, attn = model.cfg, decoder_layer(model, i).attn
    full = attn.indexer is not None
    index_q = attn.indexer.query(x, q_resid, cos, sin) if full else None
    o_lat, sel = dsa.sparse_attention(model.parallel, attn.absorb_query(q_nope, q_rope), index_q,
                                      None if full else prev, pages, i, cfg.index_slot(i) if full else 0, tables,
                                      topk=cfg.index_topk, softmax_scale=cfg.softmax_scale, attention=attention)
    return attn.absorb_output(o_lat, q_nope.dtype), sel
