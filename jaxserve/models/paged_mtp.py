"""The MTP head over the paged KV cache: the draft side of speculative decoding (`jaxserve.models.mtp` for the math).

The MTP layer's KV lives in pool layer `cfg.num_layers` (the layout has num_layers + mtp_layers layers, see
`engine.layouts.kv_layout`), at the same slots as the target's: position p's MTP row (from h_p and token p+1) is
written at p's slot with rope position p, so page ids, tags, the prefix cache and the hand-off cover it unchanged.
A chunk's rows are written by `mtp_extend` (after the target's prefill / verify of the same chunk, whose hidden
states it takes); `mtp_step` chains one more draft. Draft rows past the accepted tokens are overwritten by the next
`mtp_extend` over the accepted ones before anything reads them (lengths stop at the accepted count).
"""
from __future__ import annotations

import jax

from jaxserve.cache import KVPages, mask_outputs
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.paged import (DecodeBatch, PrefillBatch, decode_attention, guard_decode, guard_prefill,
                                   prefill_attention)
from jaxserve.models.transformer import CausalLM


def mtp_extend(model: CausalLM, pages: KVPages, batch: PrefillBatch, hidden: jax.Array, next_tokens: jax.Array, *,
               attention: AttentionBackend = AttentionBackend(), integrity: bool = True
               ) -> tuple[jax.Array, jax.Array, KVPages]:
    """The MTP rows of a chunk: row t at `batch.positions[:, t]` takes hidden[:, t] (the target's last decoder
    layer output there, `prefill(..., return_hidden=True)`) and next_tokens[:, t] (the token at position + 1),
    writes its KV into pool layer cfg.num_layers at `batch.slots` and attends over the row's MTP rows up to its
    position (`batch.ctx_lens`, `block_tables`; batch.tokens is not read). With `batch.expected_tags` the tag
    check runs first (a failed row writes nothing and gets zero logits).
    hidden [B, T, H], next_tokens [B, T] int32 -> (logits [B, T, V] f32 of the token at position + 2,
    h_mtp [B, T, H] (the MTP layer's output: the next chained step's hidden), pages)."""
    head = model.mtp
    batch, ok, slot_tags = guard_prefill(pages, batch, integrity, model.parallel)
    cos, sin = model.rope(batch.positions)
    layer = head.layer
    h = head.combine(model.embed_tokens(next_tokens), hidden)
    o, pages, _ = prefill_attention(model, model.cfg.num_layers, layer.input_norm(h), pages, batch, cos, sin, None,
                                    slot_tags, attention)
    h = h + layer.attn.o(o)
    h = h + layer.mlp(layer.post_norm(h))
    return mask_outputs(ok, model.head_logits(head.norm(h))), h, pages


def mtp_step(model: CausalLM, pages: KVPages, batch: DecodeBatch, hidden: jax.Array, *,
             attention: AttentionBackend = AttentionBackend(), integrity: bool = True
             ) -> tuple[jax.Array, jax.Array, KVPages]:
    """One chained draft step per row: the MTP row at `batch.positions` (p) from hidden (h_p: the target's hidden at
    p, or the previous MTP step's h_mtp) and `batch.tokens` (the token at p + 1: the last draft); writes its KV at
    `batch.slots` (p's slot) in pool layer cfg.num_layers and attends over `batch.lengths` (p + 1) MTP rows.
    hidden [B, H] -> (logits [B, V] f32 of the token at p + 2, h_mtp [B, H], pages)."""
    head = model.mtp
    batch, ok, slot_tags = guard_decode(pages, batch, integrity, model.parallel)
    cos, sin = model.rope(batch.positions[:, None])
    layer = head.layer
    h = head.combine(model.embed_tokens(batch.tokens[:, None]), hidden[:, None])  # [B, 1, H]
    o, pages, _ = decode_attention(model, model.cfg.num_layers, layer.input_norm(h), pages, batch, ok, cos, sin,
                                   None, slot_tags, attention)
    h = h + layer.attn.o(o)
    h = h + layer.mlp(layer.post_norm(h))
    return mask_outputs(ok, model.head_logits(head.norm(h[:, 0]))), h[:, 0], pages
