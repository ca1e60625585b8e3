"""Building blocks shared by the three model families: RMSNorm, format-aware Linear, SwiGLU MLP, routed MoE."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models import sharded
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
        self.backend = "gpu"  # the kernels' tiling: "gpu" (Triton) or "tpu" (Mosaic)
        self.parallel = None  # a jaxserve.sharding.Parallel once `shard_model` placed the model on a mesh
        self.path = ""  # this module's parameter path (the sharding table's key), set with `parallel`
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (din, dout), jnp.float32) * INIT_STD).astype(dtype))
        self.scale = nnx.data(None)  # set to a Param when the weight is quantized
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else None

    def dense_weight(self) -> jax.Array:
        """The weight as a dense [din, dout] array (dequantized f32 for quantized formats)."""
        if self.fmt in DENSE_FORMATS:
            return self.weight[...]
        return formats.dequantize(self.weight[...], self.scale[...], self.fmt)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.parallel is not None:
            return sharded.linear(self, x)
        return self.local(x, self.weight[...], None if self.scale is None else self.scale[...],
                          None if self.bias is None else self.bias[...])

    def local(self, x: jax.Array, w: jax.Array, scale: jax.Array | None, bias: jax.Array | None) -> jax.Array:
        """The matmul on given (possibly per-shard) arrays: x [..., din] @ w -> [..., dout] x.dtype."""
        y = ops.linear(x, w, scale, self.fmt, use_kernel=self.use_kernel, interpret=self.interpret,
                       backend=self.backend)
        return y if bias is None else y + bias.astype(y.dtype)


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
        self.backend = "gpu"

        def init(shape: tuple[int, ...]) -> nnx.Param:
            return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD).astype(dtype))

        self.gate = init((n, hidden, inter))
        self.up = init((n, hidden, inter))
        self.down = init((n, inter, hidden))
        self.gate_scale = nnx.data(None)  # scales appear when the experts are quantized
        self.up_scale = nnx.data(None)
        self.down_scale = nnx.data(None)

    def __call__(self, x_sorted: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """x_sorted [M, H] (rows grouped by expert), group_sizes [E] int32 -> [M, H]; rows past the sum give 0."""

        def mm(x: jax.Array, w: nnx.Param, s: nnx.Param | None) -> jax.Array:
            return ops.grouped_linear(x, w[...], None if s is None else s[...], group_sizes, self.fmt,
                                      use_kernel=self.use_kernel, interpret=self.interpret, backend=self.backend)

        h = jax.nn.silu(mm(x_sorted, self.gate, self.gate_scale)) * mm(x_sorted, self.up, self.up_scale)
        return mm(h, self.down, self.down_scale)

    def gathered(self, x: jax.Array, expert: jax.Array) -> jax.Array:
        """x [M, H], expert [M] int32 (E: no expert, gives 0) -> [M, H]: each row through its own expert's weights,
        gathered (and dequantized) per row. The XLA path at decode sizes: reads M experts, not all E."""
        valid = expert < self.gate.shape[0]
        e = jnp.where(valid, expert, 0)

        def mm(x: jax.Array, w: nnx.Param, s: nnx.Param | None) -> jax.Array:
            wd = w[...][e] if s is None else formats.dequantize(w[...][e], s[...][e], self.fmt)
            return jnp.einsum("mk,mkn->mn", x, wd.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)

        h = jax.nn.silu(mm(x, self.gate, self.gate_scale)) * mm(x, self.up, self.up_scale)
        return jnp.where(valid[:, None], mm(h, self.down, self.down_scale), 0)

    def dense_all(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        """x [N, H], weight [N, E] f32 (a row's routing weight of each expert, 0 where unrouted) -> [N, H] f32:
        every row through every expert (f32 / bf16 weights only), with no batched matmul: gate and up as one
        [N, H] x [H, E * I] product each, and the weighted sum over experts folded into the down projection as
        [N, E * I] x [E * I, H]. The XLA path when N x E rows are fewer than the grouped matmul's padded tiles."""
        n = x.shape[0]
        e, _, inter = self.gate.shape

        def up_proj(w: nnx.Param) -> jax.Array:
            return jnp.einsum("nh,ehi->nei", x, w[...].astype(x.dtype),
                              preferred_element_type=jnp.float32).astype(x.dtype)

        h = jax.nn.silu(up_proj(self.gate)) * up_proj(self.up)  # [N, E, I]
        # an unrouted expert's activations are dropped, not scaled by 0 (an inf there must not reach the row)
        hw = jnp.where(weight[..., None] != 0, h.astype(jnp.float32) * weight[..., None], 0).astype(x.dtype)
        down = self.down[...].astype(x.dtype).reshape(e * inter, -1)
        return jnp.dot(hw.reshape(n, e * inter), down, preferred_element_type=jnp.float32)


class MoE(nnx.Module):
    """Sigmoid-scored, group-limited top-k routing with score-correction bias, routed + shared experts."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        E, H = cfg.n_routed_experts, cfg.hidden_size
        # The router stays f32: expert choice is sensitive to rounding (HF keeps it f32 too).
        self.parallel = None  # set by `shard_model` (see Linear)
        self.path = ""
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
        if self.parallel is not None:
            return sharded.moe(self, x)
        flat = x.reshape(-1, x.shape[-1])
        w, ids = self.route(flat)
        out = self.routed(flat, w, ids, 0).astype(x.dtype)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(x.shape)

    def routed(self, flat: jax.Array, w: jax.Array, ids: jax.Array, first_expert: int | jax.Array) -> jax.Array:
        """The routed experts' sum over the experts this module holds, [first_expert, first_expert + E_local).

        flat [N, H]; w, ids [N, k] from `route` (global expert ids) -> [N, H] f32 (a partial sum when the experts
        are split over devices: pairs routed elsewhere contribute 0 here)."""
        n, k = ids.shape
        e_local = self.experts.gate.shape[0]
        local = ids - first_expert
        local = jnp.where((local >= 0) & (local < e_local), local, e_local).reshape(-1)  # e_local: not here
        weight = w.reshape(-1)
        token = jnp.arange(n * k, dtype=jnp.int32) // k
        kernel = self.experts.use_kernel and self.experts.fmt in ("int4", "fp8")
        if not kernel and n * k <= e_local:
            # fewer (token, slot) pairs than experts: gathering each pair's expert reads less than all experts
            y = self.experts.gathered(flat[token], local)
            contrib = y.astype(jnp.float32) * weight[:, None]
            return jnp.zeros((n, flat.shape[-1]), jnp.float32).at[token].add(contrib)
        if not kernel and self.experts.fmt in DENSE_FORMATS and \
                n * e_local < ops.xla_tile_rows(n * k, e_local) * min(e_local, n * k):
            # every token through every expert is fewer rows than the pairs' padded tiles, and no tile loop (the
            # embedded model's decode program at batch 8: 3.14 vs 3.30 ms on one core; at 16, rows equal, no gain)
            per_expert = jnp.zeros((n, e_local + 1), jnp.float32).at[token, local].add(weight)[:, :e_local]
            return self.experts.dense_all(flat, per_expert)
        # sort the pairs by expert so each expert's rows are contiguous for the grouped matmul; pairs of experts
        # held elsewhere sort last and fall past sum(group_sizes), where the grouped matmul gives 0
        order = jnp.argsort(local, stable=True)
        group_sizes = jnp.bincount(local, length=e_local + 1)[:e_local].astype(jnp.int32)
        y_sorted = self.experts(flat[token[order]], group_sizes)
        contrib = y_sorted.astype(jnp.float32) * weight[order][:, None]
        return jnp.zeros((n, flat.shape[-1]), jnp.float32).at[token[order]].add(contrib)
