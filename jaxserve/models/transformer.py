"""The causal LM for all three families: embeddings, decoder layers (attention + dense MLP or MoE), final norm, head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models import sharded
from jaxserve.models.attention import GQAttention, MLAttention
from jaxserve.models.layers import INIT_STD, MLP, Linear, MoE, RMSNorm
from jaxserve.models.rope import cos_sin


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = (MLAttention(cfg, layer_idx, dtype=dtype, rngs=rngs) if cfg.is_mla
                     else GQAttention(cfg, dtype=dtype, rngs=rngs))
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = (MoE(cfg, dtype=dtype, rngs=rngs) if cfg.mlp_layer_types[layer_idx] == "sparse"
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs))


class CausalLM(nnx.Module):
    """tokens [B, T] int32 -> logits [B, T, vocab] f32. One definition for deepseek_v3, glm_moe_dsa and glm4_moe."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        self.parallel = None  # set by `jaxserve.models.sharded.shard_model`
        self.path = ""
        self.embed = nnx.Param(
            (jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32) * INIT_STD).astype(dtype)
        )
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype,
                                                                   rngs=rngs)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """positions [B, T] -> cos, sin [B, T, rope_dim // 2] f32."""
        return cos_sin(positions, self.cfg.rope, self.cfg.rope_dim)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] int32 -> [B, T, H]."""
        if self.parallel is not None:
            return sharded.embed(self, tokens)
        return jnp.take(self.embed[...], tokens, axis=0)

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., H] (before the final norm) -> logits [..., V] f32."""
        h = self.norm(h)
        if self.lm_head is None and self.parallel is not None:
            return sharded.tied_logits(self, h)
        if self.lm_head is None:
            return jnp.dot(h, self.embed[...].T.astype(h.dtype), preferred_element_type=jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, lengths: jax.Array | None = None,
                 *, absorbed: bool = False) -> jax.Array:
        """Full-sequence forward over a dense context (no cache).

        tokens [B, T] int32; positions [B, T] int32 (default arange); lengths [B] int32 valid tokens per row
        (right padding; default T). absorbed: MLA in the absorbed form. -> logits [B, T, V] f32.
        """
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if lengths is None:
            lengths = jnp.full((B,), T, jnp.int32)
        valid = jnp.arange(T)[None, :] < lengths[:, None]
        mask = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]  # [B, T(query), S(key)]
        cos, sin = self.rope(positions)
        h = self.embed_tokens(tokens)
        selected = None
        for layer in self.layers:
            a, selected = layer.attn(layer.input_norm(h), cos, sin, mask, absorbed=absorbed, prev_selected=selected)
            h = h + a
            h = h + layer.mlp(layer.post_norm(h))
        return self.logits(h)


@nnx.jit(static_argnames=("absorbed",))
def forward(model: CausalLM, tokens: jax.Array, positions: jax.Array | None = None, lengths: jax.Array | None = None,
            absorbed: bool = False) -> jax.Array:
    """The jitted full-sequence forward: see CausalLM.__call__."""
    return model(tokens, positions, lengths, absorbed=absorbed)
