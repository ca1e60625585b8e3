"""Building blocks shared by the three model families: RMSNorm, format-aware Linear, SwiGLU MLP, routed MoE."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.quant import formats, ops

INIT_STD = 0.02
DENSE_FORMATS = ("f32", "bf16")


class RMSNorm(nnx.Module):
    """x [..., D] -> [..., D]; computes in f32, casts back to x.dtype, then multiplies by the weight (HF order)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
    """x [..., D] -> [..., D] with weight and bias (the DSA indexer's k_norm)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean((xf - mu) ** 2, axis=-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Linear(nnx.Module):
    """x [..., din] -> [..., dout]. `weight` is [din, dout] in `fmt` ("bf16", "f32", "fp8", "int4"), `scale` beside it."""

    def __init__(self, din: int, dout: int, *, dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = False) -> None:
        self.fmt = "f32" if dtype == jnp.float32 else "bf16"
        self.use_kernel = False  # quantized formats: Pallas kernels (GPU/TPU) instead of the XLA dequant path
        self.interpret = False
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (din, dout), jnp.float32) * INIT_STD).astype(dtype))
        self.scale = nnx.data(None)  # set to a Param when the weight is quantized
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def dense_weight(self) -> jax.Array:
        """The weight as a dense [din, dout] array (dequantized f32 for quantized formats)."""
        if self.fmt in DENSE_FORMATS:
            return self.weight[...]
        return formats.dequantize(self.weight[...], self.scale[...], self.fmt)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = ops.linear(x, self.weight[...], None if self.scale is None else self.scale[...], self.fmt,
                       use_kernel=self.use_kernel, interpret=self.interpret)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). x [..., H] -> [..., H]."""

    def __init__(self, hidden: int, inter: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.gate = Linear(hidden, inter, dtype=dtype, rngs=rngs)
        self.up = Linear(hidden, inter, dtype=dtype, rngs=rngs)
        self.down = Linear(inter, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Experts(nnx.Module):
    """Stacked routed experts: gate, up [E, H, I], down [E, I, H] in `fmt`, applied by grouped matmul."""

    def __init__(self, n: int, hidden: int, inter: int, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.fmt = "f32" if dtype == jnp.float32 else "bf16"
        self.use_kernel = False
        self.interpret = False

        def init(shape: tuple[int, ...]) -> nnx.Param:
            return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD).astype(dtype))

        self.gate = init((n, hidden, inter))
        self.up = init((n, hidden, inter))
        self.down = init((n, inter, hidden))
        self.gate_scale = nnx.data(None)  # scales appear when the experts are quantized
        self.up_scale = nnx.data(None)
        self.down_scale = nnx.data(None)

    def __call__(self, x_sorted: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """x_sorted [M, H] (rows grouped by expert), group_sizes [E] int32 -> [M, H]."""

        def mm(x: jax.Array, w: nnx.Param, s: nnx.Param | None) -> jax.Array:
            return ops.grouped_linear(x, w[...], None if s is None else s[...], group_sizes, self.fmt,
                                      use_kernel=self.use_kernel, interpret=self.interpret)

        h = jax.nn.silu(mm(x_sorted, self.gate, self.gate_scale)) * mm(x_sorted, self.up, self.up_scale)
        return mm(h, self.down, self.down_scale)


class MoE(nnx.Module):
    """Sigmoid-scored, group-limited top-k routing with score-correction bias, routed + shared experts."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        E, H = cfg.n_routed_experts, cfg.hidden_size
        # The router stays f32: expert choice is sensitive to rounding (HF keeps it f32 too).
        self.router = nnx.Param(jax.random.normal(rngs.params(), (H, E), jnp.float32) * INIT_STD)
        self.router_bias = nnx.Param(jnp.zeros((E,), jnp.float32))
        self.experts = Experts(E, H, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs)
        self.shared = (
            MLP(H, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype=dtype, rngs=rngs)
            if cfg.n_shared_experts else None
        )

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, H] -> (weights [N, k] f32, expert ids [N, k] int32)."""
        cfg = self.cfg
        E, G = cfg.n_routed_experts, cfg.n_group
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ self.router[...])
        choice = scores + self.router_bias[...]
        if G > 1:
            grouped = choice.reshape(-1, G, E // G)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
            _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
            keep = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(x.shape[0])[:, None], top_groups].set(True)
            choice = jnp.where(jnp.repeat(keep, E // G, axis=1), choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
        w = jnp.take_along_axis(scores, ids, axis=1)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return w * cfg.routed_scaling_factor, ids.astype(jnp.int32)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, H] -> [B, T, H]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, k, E = flat.shape[0], self.cfg.num_experts_per_tok, self.cfg.n_routed_experts
        w, ids = self.route(flat)
        # Sort the (token, slot) pairs by expert so each expert's rows are contiguous for the grouped matmul.
        flat_ids = ids.reshape(-1)
        order = jnp.argsort(flat_ids, stable=True)
        token_of = order // k
        group_sizes = jnp.bincount(flat_ids, length=E).astype(jnp.int32)
        y_sorted = self.experts(flat[token_of], group_sizes)
        contrib = y_sorted.astype(jnp.float32) * w.reshape(-1)[order][:, None]
        out = jnp.zeros((n, shape[-1]), jnp.float32).at[token_of].add(contrib)
        out = out.astype(x.dtype)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(shape)
