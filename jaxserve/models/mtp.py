"""The multi-token-prediction (MTP) head of DeepSeek-V3 / GLM-4.5 / GLM-5.x checkpoints (layer num_hidden_layers).

Position p's MTP row: h = eh_proj(concat[enorm(embed(token_{p+1})), hnorm(h_p)]) with h_p the main model's last
decoder layer output at p (before the final norm), then one full decoder layer (its own attention at rope position
p, over the MTP rows of positions <= p, and its MLP / MoE), then `shared_head.norm` and the main lm_head: the logits
of token_{p+2}. The layer's output (before the norm) is the next chained step's h. The head reuses the main
embedding and lm_head (the copies some checkpoints store beside it are ignored, as transformers ignores them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.decoder import DecoderLayer, causal_mask
from jaxserve.models.layers import Linear, RMSNorm
from jaxserve.quant.weight_format import WeightPlan
from jaxserve.sharding import Parallel

PATH = "mtp"  # the head's parameter path (and checkpoint group)


class MTPHead(nnx.Module):
    """enorm, hnorm [H]; eh_proj [2H, H] (replicated: the input concatenates two full hidden vectors); `layer`, the
    decoder layer of index cfg.num_layers; `norm` (shared_head.norm) [H]."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, weights: WeightPlan = WeightPlan(),
                 parallel: Parallel | None = None) -> None:
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * H, H, axes=(None, None), dtype=dtype, rngs=rngs,
                              fmt=weights.linear(f"{PATH}.eh_proj", 2 * H), parallel=parallel)
        self.layer = DecoderLayer(cfg, cfg.num_layers, dtype=dtype, rngs=rngs, weights=weights, parallel=parallel,
                                  path=f"{PATH}.layer")
        self.norm = RMSNorm(H, cfg.rms_norm_eps, dtype=dtype)

    def combine(self, embedded: jax.Array, hidden: jax.Array) -> jax.Array:
        """embedded [..., H] (the next tokens' embeddings), hidden [..., H] (the previous hidden) -> the layer's
        input [..., H] in hidden's dtype."""
        x = jnp.concatenate([self.enorm(embedded), self.hnorm(hidden.astype(embedded.dtype))], axis=-1)
        return self.eh_proj(x)


def mtp_forward(model: nnx.Module, hidden: jax.Array, next_tokens: jax.Array, positions: jax.Array | None = None,
                lengths: jax.Array | None = None, *, absorbed: bool = False) -> tuple[jax.Array, jax.Array]:
    """The MTP head over a dense context (the reference for the paged path). `model` is a CausalLM with `mtp`.

    hidden [B, T, H] (the main model's last layer output, `CausalLM.hidden`), next_tokens [B, T] int32 (the token
    after each position), positions [B, T] int32 (default arange), lengths [B] int32 (right padding) ->
    (logits [B, T, V] f32 of the token two past each position, h_mtp [B, T, H] before the head's norm)."""
    head: MTPHead = model.mtp
    positions, mask = causal_mask(*next_tokens.shape, positions, lengths)
    cos, sin = model.rope(positions)
    h = head.combine(model.embed_tokens(next_tokens), hidden)
    h, _ = head.layer(h, cos, sin, mask, absorbed=absorbed, prev_selected=None)
    return model.head_logits(head.norm(h)), h
