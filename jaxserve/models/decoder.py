"""One decoder layer of the three families (attention + dense MLP or MoE), shared by the main stack and the MTP head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.attention import GQAttention, MLAttention
from jaxserve.models.layers import MLP, MoE, RMSNorm
from jaxserve.quant.weight_format import WeightPlan
from jaxserve.sharding import Parallel


def causal_mask(B: int, T: int, positions: jax.Array | None, lengths: jax.Array | None
                ) -> tuple[jax.Array, jax.Array]:
    """A dense context's positions [B, T] int32 (default arange) and causal mask [B, T(query), S(key)] bool with
    right padding past lengths [B] (default T)."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if lengths is None:
        lengths = jnp.full((B,), T, jnp.int32)
    valid = jnp.arange(T)[None, :] < lengths[:, None]
    return positions, (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)). Layer `layer_idx` of the config (index
    num_layers is the MTP layer: its MLP kind is `cfg.mtp_mlp_type`). Its parameters sit under `path` (default
    `layers.{layer_idx}`): its Linears' formats are looked up in `weights` by that path."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 weights: WeightPlan = WeightPlan(), parallel: Parallel | None = None, path: str | None = None) -> None:
        path = path or f"layers.{layer_idx}"
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.attn = (MLAttention(cfg, layer_idx, dtype=dtype, rngs=rngs, path=f"{path}.attn", weights=weights,
                                 parallel=parallel) if cfg.is_mla
                     else GQAttention(cfg, dtype=dtype, rngs=rngs, path=f"{path}.attn", weights=weights,
                                      parallel=parallel))
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        mlp = f"{path}.mlp"
        self.mlp = (MoE(cfg, dtype=dtype, rngs=rngs, path=mlp, weights=weights, parallel=parallel)
                    if cfg.mlp_type(layer_idx) == "sparse"
                    else MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs, path=mlp, weights=weights,
                             parallel=parallel))

    def __call__(self, h: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, *, absorbed: bool,
                 prev_selected: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """Over a dense context: h [B, T, H], cos/sin [B, T, rope_dim // 2], mask [B, T, S] bool -> (h [B, T, H],
        the DSA selection [B, T, S] bool or None)."""
        a, selected = self.attn(self.input_norm(h), cos, sin, mask, absorbed=absorbed, prev_selected=prev_selected)
        h = h + a
        return h + self.mlp(self.post_norm(h)), selected
