"""Building blocks shared by the three model families: RMSNorm, format-aware Linear, SwiGLU MLP, routed MoE."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.models import sharded
from jaxserve.quant import formats, ops
from jaxserve.quant.weight_format import MatmulFormat, WeightPlan, dense_format
from jaxserve.sharding import Axes, Blocks, Parallel, ShardingError, local_scale, split_axes

INIT_STD = 0.02
DENSE_FORMATS = ("f32", "bf16")
DENSE_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# products of at most this many rows read a Linear's f32 twin (`MatmulFormat.wide`): from 2 rows on XLA:CPU's bf16
# dot beat the twin's f32 one, decode and c = 1 verify alike (bench/step_cuts.py --variants now,wide64)
WIDE_ROWS = 1
# `MoE.routed_by_slots` runs where its [experts, capacity, max(hidden, ffn)] activations stay this small (the embedded
# model's decode and verify on CPU; a real model's prefill keeps the grouped matmul, whose temporaries are one tile)
SLOTS_MAX_ELEMENTS = 1 << 20
# `MoE.routed` runs dense_all for up to this many token rows where the experts hold the gate_up twin: measured up to
# EngineConfig's default max_batch (bench/results/step_cuts_gateup.json); wider batches keep the slots
GATE_UP_ROWS = 32
M = TypeVar("M")


class _OneKey:
    """An nnx.Rngs stand-in for shape-only builds: every `params()` draw is the same key, nothing counted."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract_build(make: Callable[[nnx.Rngs], M]) -> M:
    """`make(rngs)` under nnx.eval_shape (parameters as ShapeDtypeStructs, nothing allocated). Its initializers draw
    one fixed key: nnx.Rngs counts draws in a traced Variable whose every update makes JAX walk the whole trace so
    far (flax compares the tracer's missing `sharding`), quadratic in the parameter count (minutes for GLM-5.2)."""
    return nnx.eval_shape(lambda: make(_OneKey()))  # type: ignore[arg-type]


class RMSNorm(nnx.Module):
    """x [..., D] -> [..., D]; computes in f32, casts back to x.dtype, then multiplies by the weight (HF order)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(None,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
    """x [..., D] -> [..., D] with weight and bias (the DSA indexer's k_norm)."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(None,))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype), axes=(None,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean((xf - mu) ** 2, axis=-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up [..., I] in gate's dtype, the silu computed in f32 and rounded once, as torch's bf16 silu does
    (jax.nn.silu on bf16 rounds after each of its ops: a chain of converts on XLA:CPU, bench/step_cuts.py "swiglu").
    f32 inputs: the same values as jax.nn.silu's."""
    return jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up


def _wide(weight: nnx.Param, fmt: MatmulFormat, stored: str, axes: Axes) -> nnx.Param | None:
    """The f32 twin of a bf16 weight when `fmt.wide` (`MatmulFormat.wide`), else None: the same values, exactly."""
    if not fmt.wide or stored != "bf16":
        return None
    return nnx.Param(weight[...].astype(jnp.float32), axes=axes)


def _init(rngs: nnx.Rngs, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(rngs.params(), shape, jnp.float32) * INIT_STD


def _weight(dense: jax.Array, fmt: MatmulFormat, stored: str, dtype: jnp.dtype, axes: Axes
            ) -> tuple[nnx.Param, nnx.Param | None]:
    """A weight (and its scale, None for dense formats) in format `stored`, from f32 values `dense`."""
    if stored in DENSE_FORMATS:  # the module's dtype, or the other dense format a quantized weight was expanded to
        to = dtype if stored == dense_format(dtype) else DENSE_DTYPES[stored]
        return nnx.Param(dense.astype(to), axes=axes), None
    w, s = formats.quantize(dense.astype(dtype).astype(jnp.float32), stored, fmt.group_size)
    blocks = Blocks(tuple(w.shape), (1,) * (w.ndim - 2) + formats.scale_tile(stored, fmt.group_size))
    return nnx.Param(w, axes=axes, blocks=blocks), nnx.Param(s, axes=axes, blocks=replace(blocks, scale=True))


class Linear(nnx.Module):
    """x [..., din] -> [..., dout]. `weight` is [din, dout] in `fmt` ("bf16", "f32", "fp8", "int4"), `scale` beside it.

    axes: the weight's logical axes (the bias takes the output one); `parallel`: the mesh it is placed on (a split
    input dim makes it row-parallel, a split output dim column-parallel); `fmt`: its format and kernel switches."""

    def __init__(self, din: int, dout: int, *, axes: Axes, dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = False,
                 fmt: MatmulFormat = MatmulFormat(), parallel: Parallel | None = None) -> None:
        self.fmt = fmt.resolve(dtype)
        self.use_kernel = fmt.use_kernel  # quantized formats: Pallas kernels (GPU/TPU) instead of the XLA dequant path
        self.interpret = fmt.interpret
        self.backend = fmt.backend  # the kernels' tiling: "gpu" (Triton) or "tpu" (Mosaic)
        self.parallel = parallel
        self.weight, scale = _weight(_init(rngs, (din, dout)), fmt, self.fmt, dtype, axes)
        if self.use_kernel and self.backend == "tpu" and scale is not None:  # sharding.param_format
            # the Mosaic kernels read it row-major; XLA:TPU's default put the long dim minor when a shard is
            # narrower than a lane tile (GLM-5.2's 64-wide shared expert at 32 chips), copied back on every call
            self.weight.set_metadata("tpu_major_to_minor", (0, 1))
        self.scale = nnx.data(scale)
        self.wide = nnx.data(_wide(self.weight, fmt, self.fmt, axes))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype), axes=axes[1:]) if bias else None

    def dense_weight(self) -> jax.Array:
        """The weight as a dense [din, dout] array (dequantized f32 for quantized formats; the f32 twin if held)."""
        if self.wide is not None:
            return self.wide[...]
        if self.fmt in DENSE_FORMATS:
            return self.weight[...]
        return formats.dequantize(self.weight[...], local_scale(self.parallel, self.scale, self.weight.shape),
                                  self.fmt)

    def __call__(self, x: jax.Array) -> jax.Array:
        par = self.parallel
        axes = split_axes(par, "weight", self.weight) if par is not None else (None, None)
        k_ax, n_ax = (None, None) if par is None else (par.axis(axes[0]), par.axis(axes[1]))
        if k_ax is None and n_ax is None and (par is None or not self.use_kernel or self.fmt in DENSE_FORMATS):
            return self.local(x)  # a kernel (no SPMD rule) runs in a shard_map even when nothing is split
        if k_ax is not None and n_ax is not None:
            raise ShardingError(f"a linear with both dims split: {axes}", value=axes, param="axes")
        lead = (par.axis("batch"),) + (None,) * (x.ndim - 2)
        specs = (P(*lead, k_ax), P(*lead, n_ax))
        if k_ax is None:  # column-parallel: this device's output columns
            return sharded.per_shard(self, lambda m, x: m.local(x), x, *specs)

        def body(m: Linear, x: jax.Array) -> jax.Array:  # row-parallel: partial sums over the split input dim
            y = jax.lax.psum(m.local(x, bias=False), k_ax)
            return y if m.bias is None else y + m.bias[...].astype(y.dtype)

        return sharded.per_shard(self, body, x, *specs)

    def local(self, x: jax.Array, *, bias: bool = True) -> jax.Array:
        """The matmul on this module's arrays (one shard's, inside a shard_map): x [..., din] -> [..., dout]."""
        scale = None if self.scale is None else local_scale(self.parallel, self.scale, self.weight.shape)
        w, fmt = self.weight[...], self.fmt
        if self.wide is not None and x.size <= WIDE_ROWS * x.shape[-1]:  # few rows: the f32 twin (WIDE_ROWS)
            w, fmt = self.wide[...], "f32"
        y = ops.linear(x, w, scale, fmt, use_kernel=self.use_kernel, interpret=self.interpret, backend=self.backend)
        return y if self.bias is None or not bias else y + self.bias[...].astype(y.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). x [..., H] -> [..., H]; the intermediate dim is the "ffn" axis.
    path: this module's parameter path (its Linears' formats are looked up in `weights` by path)."""

    def __init__(self, hidden: int, inter: int, *, dtype: jnp.dtype, rngs: nnx.Rngs, path: str,
                 weights: WeightPlan = WeightPlan(), parallel: Parallel | None = None) -> None:
        def linear(name: str, din: int, dout: int, axes: Axes) -> Linear:
            return Linear(din, dout, axes=axes, dtype=dtype, rngs=rngs, fmt=weights.linear(f"{path}.{name}", din),
                          parallel=parallel)

        self.gate = linear("gate", hidden, inter, ("embed", "ffn"))
        self.up = linear("up", hidden, inter, ("embed", "ffn"))
        self.down = linear("down", inter, hidden, ("ffn", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(swiglu(self.gate(x), self.up(x)))

    def local(self, x: jax.Array) -> jax.Array:
        """On this module's arrays (FFN-split inside a shard_map: a partial sum of the output). x [N, H] -> [N, H]."""
        return self.down.local(swiglu(self.gate.local(x), self.up.local(x)))


class Experts(nnx.Module):
    """Stacked routed experts: gate, up [E, H, I], down [E, I, H] in `fmt`, applied by grouped matmul. No f32 twins
    (`fmt.wide` is for Linear): their one-row products gather the bf16 weights (`gathered`). With `fmt.gate_up` a
    dense single-device block also holds gate_up [H, 2, E, I] (`gate_up_of`) for `dense_all`."""

    def __init__(self, n: int, hidden: int, inter: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 fmt: MatmulFormat = MatmulFormat(), parallel: Parallel | None = None) -> None:
        self.fmt = fmt.resolve(dtype)
        self.parallel = parallel  # where a scale is kept whole, mm slices this device's block
        self.use_kernel = fmt.use_kernel
        self.interpret = fmt.interpret
        self.backend = fmt.backend
        up_axes, down_axes = ("experts", "embed", "expert_ffn"), ("experts", "expert_ffn", "embed")
        self.gate, gate_scale = _weight(_init(rngs, (n, hidden, inter)), fmt, self.fmt, dtype, up_axes)
        self.up, up_scale = _weight(_init(rngs, (n, hidden, inter)), fmt, self.fmt, dtype, up_axes)
        self.down, down_scale = _weight(_init(rngs, (n, inter, hidden)), fmt, self.fmt, dtype, down_axes)
        for p in (self.gate, self.up, self.down, gate_scale, up_scale, down_scale):
            if p is not None:  # the sharding rules keep a too-narrow FFN split whole (sharding._narrow_experts)
                p.set_metadata("experts", (n, inter))
        self.gate_scale = nnx.data(gate_scale)  # None for dense formats
        self.up_scale = nnx.data(up_scale)
        self.down_scale = nnx.data(down_scale)
        twin = fmt.gate_up and self.fmt in DENSE_FORMATS and parallel is None
        self.gate_up = nnx.data(nnx.Param(self.gate_up_of(self.gate[...], self.up[...]),
                                          axes=("embed", None, "experts", "expert_ffn")) if twin else None)

    @staticmethod
    def gate_up_of(gate: jax.Array, up: jax.Array) -> jax.Array:
        """gate, up [E, H, I] -> the `gate_up` twin [H, 2, E, I] (the same values): dense_all's gate and up as one
        [N, H] x [H, 2 * E * I] product, which from the [E, H, I] stacks XLA:CPU transposed on every call."""
        return jnp.stack([gate, up]).transpose(2, 0, 1, 3)

    def __call__(self, x: jax.Array, group_sizes: jax.Array, rows: jax.Array | None = None) -> jax.Array:
        """x [M, H] rows grouped by expert, or x [X, H] and rows [M] int32 (sorted row r is x[rows[r]]: the kernels
        read x's rows in place, no sorted copy), group_sizes [E] int32 -> [M, H]; rows past the sum give 0."""

        def mm(x: jax.Array, w: nnx.Param, s: nnx.Param | None, rows: jax.Array | None = None) -> jax.Array:
            scale = None if s is None else local_scale(self.parallel, s, w.shape)
            return ops.grouped_linear(x, w[...], scale, group_sizes, self.fmt,
                                      use_kernel=self.use_kernel, interpret=self.interpret, backend=self.backend,
                                      rows=rows)

        h = swiglu(mm(x, self.gate, self.gate_scale, rows), mm(x, self.up, self.up_scale, rows))
        return mm(h, self.down, self.down_scale)

    def gathered(self, x: jax.Array, expert: jax.Array) -> jax.Array:
        """x [M, H], expert [M] int32 (E: no expert, gives 0) -> [M, H]: each row through its own expert's weights,
        gathered (and dequantized) per row. The XLA path at decode sizes: reads M experts, not all E.
        A bf16 weight is gathered as it is: XLA:CPU converts the gathered copy to f32 inside the gather (the same
        values, the same f32 product), reading half the bytes a gather of an f32 twin read (the c = 1 verify's 8
        expert copies a layer, bench/results/step_cuts_gather_c1.json "gbf16"), so the experts hold no twin."""
        valid = expert < self.gate.shape[0]
        e = jnp.where(valid, expert, 0)

        def mm(x: jax.Array, w: nnx.Param, s: nnx.Param | None) -> jax.Array:
            wd = (w[...][e] if s is None else formats.dequantize(
                w[...][e], local_scale(self.parallel, s, w.shape)[e], self.fmt)).astype(x.dtype)
            return jnp.einsum("mk,mkn->mn", x, wd, preferred_element_type=jnp.float32).astype(x.dtype)

        h = swiglu(mm(x, self.gate, self.gate_scale), mm(x, self.up, self.up_scale))
        return jnp.where(valid[:, None], mm(h, self.down, self.down_scale), 0)

    def _gated(self, xe: jax.Array) -> jax.Array:
        """xe [E, N, H] (row block e for expert e) -> silu(gate) * up [E, N, I] in xe.dtype (f32 / bf16 weights)."""

        def up_proj(w: nnx.Param) -> jax.Array:
            # batched over experts: as one [N, H] x [H, E * I] product XLA:CPU copied each [E, H, I] weight to
            # [H, E, I] on every call (2 MB a layer at the c = 1 verify; bench/spec_profile.py --ops)
            return jnp.einsum("enh,ehi->eni", xe, w[...].astype(xe.dtype),
                              preferred_element_type=jnp.float32).astype(xe.dtype)

        return swiglu(up_proj(self.gate), up_proj(self.up))

    def per_expert(self, xe: jax.Array) -> jax.Array:
        """xe [E, C, H]: row block e through expert e alone (f32 / bf16 weights), one batched product per projection
        -> [E, C, H] f32 (`MoE.routed_by_slots`)."""
        return jnp.einsum("eci,eih->ech", self._gated(xe), self.down[...].astype(xe.dtype),
                          preferred_element_type=jnp.float32)

    def dense_all(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        """x [N, H], weight [N, E] f32 (a row's routing weight of each expert, 0 where unrouted) -> [N, H] f32:
        every row through every expert (f32 / bf16 weights only): gate and up batched over experts, or with the
        `gate_up` twin as one [N, H] x [H, 2 * E * I] product, and the weighted sum over experts folded into the down
        projection as [N, E * I] x [E * I, H]. The XLA path when N x E rows are fewer than the grouped matmul's padded
        tiles, and with the twin up to GATE_UP_ROWS rows."""
        n, hidden = x.shape
        e, _, inter = self.gate.shape
        down = self.down[...].astype(x.dtype).reshape(e * inter, -1)
        if self.gate_up is not None:
            gu = jnp.dot(x, self.gate_up[...].reshape(hidden, 2 * e * inter).astype(x.dtype),
                         preferred_element_type=jnp.float32).reshape(n, 2, e, inter)
            # each half rounded after the split: the product rounded whole, then split, made XLA:CPU's fused loop slow
            h = swiglu(gu[:, 0].astype(x.dtype), gu[:, 1].astype(x.dtype))  # [N, E, I]
        else:
            h = jnp.swapaxes(self._gated(jnp.broadcast_to(x, (e, *x.shape))), 0, 1)  # [N, E, I]
        # an unrouted expert's activations are dropped, not scaled by 0 (an inf there must not reach the row)
        w = weight[..., None]  # [N, E, 1]
        hw = jnp.where(w != 0, h.astype(jnp.float32) * w, 0).astype(x.dtype)
        return jnp.dot(hw.reshape(n, e * inter), down, preferred_element_type=jnp.float32)


def slot_capacity(pairs: int, experts: int) -> int:
    """Rows per expert in `MoE.routed_by_slots`: the power of two at or above twice the mean pairs per expert, at
    most the pairs (static: shapes)."""
    mean = -(-pairs // max(1, experts))
    return min(pairs, 1 << max(0, (2 * mean - 1).bit_length()))


class MoE(nnx.Module):
    """Sigmoid-scored, group-limited top-k routing with score-correction bias, routed + shared experts."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, path: str,
                 weights: WeightPlan = WeightPlan(), parallel: Parallel | None = None) -> None:
        self.cfg = cfg
        E, H = cfg.n_routed_experts, cfg.hidden_size
        self.parallel = parallel
        # The router stays f32: expert choice is sensitive to rounding (HF keeps it f32 too). Replicated: expert
        # choice needs every score.
        self.router = nnx.Param(_init(rngs, (H, E)), axes=(None, None))
        self.router_bias = nnx.Param(jnp.zeros((E,), jnp.float32), axes=(None,))
        self.experts = Experts(E, H, cfg.moe_intermediate_size, dtype=dtype, rngs=rngs,
                               fmt=weights.experts(f"{path}.experts"), parallel=parallel)
        self.shared = (
            MLP(H, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype=dtype, rngs=rngs, path=f"{path}.shared",
                weights=weights, parallel=parallel)
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
            flat = x.reshape(-1, x.shape[-1])
            b_ax = self.parallel.axis("batch")
            # the routed sum is taken in f32 and cast once, as the unsharded path does
            return sharded.per_shard(self, MoE.local, flat, P(b_ax), P(b_ax)).reshape(x.shape)
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
            # no more (token, slot) pairs than experts: gathering each pair's expert reads no more than all experts
            # do, without dense_all's bf16 matmuls of every expert (a c = 1 verify's 4 x 2 pairs over the embedded
            # model's 8 experts: bench/step_cuts.py "g8"; with f32 twins gathered it was the other way round)
            return self.routed_by_gather(flat, token, local, weight)
        if self.experts.gate_up is not None and n <= GATE_UP_ROWS:
            # every row through every expert as two-dimensional products off the twin: at 16 and 32 rows twice the
            # slots' products and still faster on XLA:CPU (bench/results/step_cuts_gateup.json)
            return self.routed_by_dense(flat, token, local, weight)
        if not kernel and self.experts.fmt in DENSE_FORMATS and \
                n * e_local < ops.xla_tile_rows(n * k, e_local) * min(e_local, n * k):
            # every token through every expert is fewer rows than the pairs' padded tiles, and no tile loop (the
            # embedded model's decode program at batch 8: 3.14 vs 3.30 ms on one core; at 16, rows equal, no gain)
            return self.routed_by_dense(flat, token, local, weight)
        capacity = slot_capacity(n * k, e_local)
        if not kernel and self.experts.fmt in DENSE_FORMATS and \
                e_local * capacity * max(self.experts.gate.shape[1:]) <= SLOTS_MAX_ELEMENTS:
            # one batched product per projection instead of a loop trip per tile: XLA:CPU's cost is per op here
            # (the embedded model's 16-row decode 6.53 -> 5.48 ms: bench/results/step_cuts_slots.json)
            return self.routed_by_slots(flat, w, token, local, weight, capacity)
        return self.routed_by_groups(flat, w, token, local)

    def routed_by_slots(self, flat: jax.Array, w: jax.Array, token: jax.Array, local: jax.Array,
                        weight: jax.Array, capacity: int) -> jax.Array:
        """`routed` by expert slots: each expert's first `capacity` pairs (in pair order) fill its rows of an
        [E, capacity, H] batch, run through every expert as one batched product per projection; the pairs past an
        expert's capacity (skewed routing) go through `routed_by_groups`, only when there are any (a cond).
        Arguments as `routed_by_gather`, w [N, k] as `routed_by_groups` -> [N, H] f32."""
        n, hidden = flat.shape
        e_local = self.experts.gate.shape[0]
        here = local < e_local
        # each pair's place among the earlier pairs of its expert
        mine = local[:, None] == jnp.arange(e_local, dtype=local.dtype)[None, :]
        place = jnp.take_along_axis(jnp.cumsum(mine.astype(jnp.int32), axis=0),
                                    jnp.minimum(local, e_local - 1)[:, None], axis=1)[:, 0] - 1
        fits = here & (place < capacity)
        slots = e_local * capacity
        slot = jnp.where(fits, local * capacity + place, slots)  # slots: a pair with no slot (dropped write)
        src = jnp.full((slots + 1,), n, jnp.int32).at[slot].set(token.astype(jnp.int32))[:slots]  # n: an empty slot
        x = jnp.concatenate([flat, jnp.zeros((1, hidden), flat.dtype)])[src].reshape(e_local, capacity, hidden)
        y = self.experts.per_expert(x).reshape(slots, hidden)
        # a pair with no slot is dropped, not scaled by 0 (an inf in the row it reads must not reach its token)
        contrib = jnp.where(fits[:, None], y[jnp.minimum(slot, slots - 1)] * weight[:, None], 0.0)
        out = jnp.zeros((n, hidden), jnp.float32).at[token].add(contrib)
        over = here & ~fits
        rest = jax.lax.cond(jnp.any(over), lambda: self.routed_by_groups(flat, w, token,
                                                                         jnp.where(over, local, e_local)),
                            lambda: jnp.zeros((n, hidden), jnp.float32))
        return out + rest

    def routed_by_gather(self, flat: jax.Array, token: jax.Array, local: jax.Array, weight: jax.Array) -> jax.Array:
        """`routed` by gathering each (token, slot) pair's expert: flat [N, H]; token, local (this module's expert,
        E_local: none), weight [N * k] -> [N, H] f32."""
        y = self.experts.gathered(flat[token], local)
        contrib = y.astype(jnp.float32) * weight[:, None]
        return jnp.zeros((flat.shape[0], flat.shape[-1]), jnp.float32).at[token].add(contrib)

    def routed_by_dense(self, flat: jax.Array, token: jax.Array, local: jax.Array, weight: jax.Array) -> jax.Array:
        """`routed` with every token through every expert (`Experts.dense_all`), routing weights per expert column:
        arguments as `routed_by_gather`."""
        e_local = self.experts.gate.shape[0]
        per_expert = jnp.zeros((flat.shape[0], e_local + 1), jnp.float32).at[token, local].add(weight)[:, :e_local]
        return self.experts.dense_all(flat, per_expert)

    def routed_by_groups(self, flat: jax.Array, w: jax.Array, token: jax.Array, local: jax.Array) -> jax.Array:
        """`routed` by the grouped matmul over the pairs sorted by expert: flat [N, H]; w [N, k]; token, local
        [N * k] as `routed_by_gather` -> [N, H] f32."""
        n, k = w.shape
        e_local = self.experts.gate.shape[0]
        # sort the pairs by expert so each expert's rows are contiguous for the grouped matmul; pairs of experts
        # held elsewhere sort last and fall past sum(group_sizes), where the grouped matmul gives 0
        order = jnp.argsort(local, stable=True)
        group_sizes = jnp.bincount(local, length=e_local + 1)[:e_local].astype(jnp.int32)
        # the kernels (and the XLA path) take the tokens' rows by index: Triton reads them in place, Mosaic gathers
        # them once (int4: after its even/odd split of the tokens, the smaller array)
        y_sorted = self.experts(flat, group_sizes, token[order])
        # each pair's row gathered back to (token, slot) order and the k slots summed: one gather-and-reduce pass,
        # where a scatter-add read, added and wrote an f32 row of the output per pair
        unsort = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
        y = y_sorted[unsort].astype(jnp.float32).reshape(n, k, -1)
        return jnp.sum(y * w.astype(jnp.float32)[:, :, None], axis=1)

    def local(self, flat: jax.Array) -> jax.Array:
        """The block on this device's shard (inside a shard_map: experts or expert FFN split, shared expert FFN split,
        rows split under DP attention), with its collectives. flat [N_local, H] -> [N_local, H]."""
        par = self.parallel
        b_ax = par.axis("batch")
        # the axes the weights are actually split by (a dim the block-scale rule keeps whole sums nothing)
        e_split, f_split, _ = split_axes(par, "experts.down", self.experts.down)
        e_ax = par.axis(e_split)
        routed_axes = _axes_tuple(e_ax) + _axes_tuple(par.axis(f_split))
        shared_axes = () if self.shared is None else \
            _axes_tuple(par.axis(split_axes(par, "shared.down.weight", self.shared.down.weight)[0]))
        tokens = flat if b_ax is None else jax.lax.all_gather(flat, b_ax, axis=0, tiled=True)
        w, ids = self.route(tokens)
        first = 0 if e_ax is None else jax.lax.axis_index(e_ax) * self.experts.gate.shape[0]
        y = self.routed(tokens, w, ids, first)
        shared = None if self.shared is None else self.shared.local(flat).astype(jnp.float32)
        if shared is not None and b_ax is None and set(shared_axes) == set(routed_axes):
            y, shared = y + shared, None  # both partial over the same axes: one all-reduce for the block
        if b_ax is not None:
            y = jax.lax.psum_scatter(y, b_ax, scatter_dimension=0, tiled=True)  # back to this device's rows
            rest = tuple(a for a in routed_axes if a != b_ax)
            y = jax.lax.psum(y, rest) if rest else y
        elif routed_axes:
            y = jax.lax.psum(y, routed_axes)
        out = y.astype(flat.dtype)
        if shared is not None:
            shared = jax.lax.psum(shared, shared_axes) if shared_axes else shared
            out = out + shared.astype(flat.dtype)
        return out


def _axes_tuple(axes: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
