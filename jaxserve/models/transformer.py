"""The causal LM for all three families: embeddings, decoder layers (attention + dense MLP or MoE), final norm, head,
and the MTP head where the checkpoint has one."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.models.decoder import DecoderLayer, causal_mask
from jaxserve.models.layers import INIT_STD, Linear, RMSNorm
from jaxserve.models.mtp import MTPHead
from jaxserve.models.rope import cos_sin
from jaxserve.quant.weight_format import WeightPlan
from jaxserve.sharding import Parallel


class CausalLM(nnx.Module):
    """tokens [B, T] int32 -> logits [B, T, vocab] f32. One definition for deepseek_v3, glm_moe_dsa and glm4_moe.

    weights: the format of each matmul weight (default: every weight dense in `dtype`); parallel: the mesh the
    model is placed on (None: one device). Both are fixed at construction; `jaxserve.models.build` rebuilds a
    model with others. `mtp`: the MTP head (`jaxserve.models.mtp`) when cfg.mtp_layers, else None."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs,
                 weights: WeightPlan = WeightPlan(), parallel: Parallel | None = None) -> None:
        self.cfg = cfg
        self.weights = weights
        self.parallel = parallel
        self.embed = nnx.Param(
            (jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32) * INIT_STD).astype(dtype),
            axes=("vocab", "embed"))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs, weights=weights, parallel=parallel)
                                for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, axes=("embed", "vocab"), dtype=dtype, rngs=rngs,
            fmt=weights.linear("lm_head", cfg.hidden_size), parallel=parallel)
        self.mtp = (MTPHead(cfg, dtype=dtype, rngs=rngs, weights=weights, parallel=parallel) if cfg.mtp_layers
                    else None)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions [B, T] -> cos, sin [B, T, rope_dim // 2] f32."""
        return cos_sin(positions, self.cfg.rope, self.cfg.rope_dim)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int32 -> [B, T, H]."""
        par = self.parallel
        v_ax = None if par is None else par.axis("vocab")
        if v_ax is None:
            return jnp.take(self.embed[...], tokens, axis=0)
        b_ax = par.axis("batch")

        def body(tokens: jax.Array, table: jax.Array) -> jax.Array:
            # vocab-parallel: each device holds a vocab slice; rows outside it are 0; one psum
            start = jax.lax.axis_index(v_ax) * table.shape[0]
            local = tokens - start
            inside = (local >= 0) & (local < table.shape[0])
            rows = jnp.take(table, jnp.where(inside, local, 0), axis=0)
            return jax.lax.psum(jnp.where(inside[..., None], rows, 0), v_ax)

        return par.shard_map(body, (P(b_ax, None), P(v_ax, None)), P(b_ax, None, None))(tokens, self.embed[...])

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., H] (before the final norm) -> logits [..., V] f32."""
        return self.head_logits(self.norm(h))

    def head_logits(self, h: jax.Array) -> jax.Array:
        """h [..., H] (normed) -> logits [..., V] f32 through lm_head (or the tied embedding)."""
        if self.lm_head is None and self.parallel is not None:
            return self._tied_logits(h)
        if self.lm_head is None:
            return jnp.dot(h, self.embed[...].T.astype(h.dtype), preferred_element_type=jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def _tied_logits(self, h: jax.Array) -> jax.Array:
        """Logits through the (vocab-split) embedding table: h [..., H] -> [..., V] f32, split over vocab."""
        par = self.parallel
        v_ax = par.axis("vocab")
        lead = (par.axis("batch"),) + (None,) * (h.ndim - 2)

        def body(h: jax.Array, table: jax.Array) -> jax.Array:
            return jnp.dot(h, table.T.astype(h.dtype), preferred_element_type=jnp.float32)

        return par.shard_map(body, (P(*lead, None), P(v_ax, None)), P(*lead, v_ax))(h, self.embed[...])

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, lengths: jax.Array | None = None,
                 *, absorbed: bool = False) -> jax.Array:
        """Full-sequence forward over a dense context (no cache).

        tokens [B, T] int32; positions [B, T] int32 (default arange); lengths [B] int32 valid tokens per row
        (right padding; default T). absorbed: MLA in the absorbed form. -> logits [B, T, V] f32.
        """
        return self.logits(self.hidden(tokens, positions, lengths, absorbed=absorbed))

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None, lengths: jax.Array | None = None,
               *, absorbed: bool = False) -> jax.Array:
        """As __call__, but -> the last decoder layer's output [B, T, H] (before the final norm)."""
        positions, mask = causal_mask(*tokens.shape, positions, lengths)
        cos, sin = self.rope(positions)
        h = self.embed_tokens(tokens)
        selected = None
        for layer in self.layers:
            h, selected = layer(h, cos, sin, mask, absorbed=absorbed, prev_selected=selected)
        return h


@nnx.jit(static_argnames=("absorbed",))
def forward(model: CausalLM, tokens: jax.Array, positions: jax.Array | None = None, lengths: jax.Array | None = None,
            absorbed: bool = False) -> jax.Array:
    """The jitted full-sequence forward: see CausalLM.__call__."""
    return model(tokens, positions, lengths, absorbed=absorbed)
