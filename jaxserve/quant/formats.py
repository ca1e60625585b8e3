"""jaxserve's runtime weight formats, their quantizers, and exact conversions from the HF on-disk layouts.

A linear weight is `(w, scale)` plus a format name `fmt`; the model computes `x @ W` with W [K=in, N=out]:

| fmt    | w                                   | scale                                         | W[k, n]                              |
|--------|-------------------------------------|-----------------------------------------------|--------------------------------------|
| "bf16" | [K, N] bfloat16                     | None                                          | w[k, n]                              |
| "f32"  | [K, N] float32                      | None                                          | w[k, n]                              |
| "fp8"  | [K, N] float8_e4m3fn                | [ceil(K/128), ceil(N/128)] float32            | w[k, n] * scale[k // 128, n // 128]  |
| "int4" | [K//2, N] uint8 (two k per byte)    | [K//g, N] bfloat16, g = K // scale.shape[-2]  | (nib(k, n) - 8) * scale[k // g, n]   |

INT4 packing: byte [j, n] holds k = 2j in the low nibble and k = 2j + 1 in the high nibble; nibble = q + 8 with
q in [-8, 7] (symmetric, no zero point). K must be a multiple of g. Expert weights carry a leading E axis on
both `w` and `scale`. The FP8 tiles are HF's `weight_scale_inv` tiles transposed; the INT4 groups are
compressed-tensors' groups along the input dim, so both HF conversions are exact (no requantization).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Final

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.errors import CheckpointError, ConfigError
from jaxserve.format_names import FORMATS
from jaxserve.quant import hf_formats

FP8_BLOCK: Final = 128
FP8_MAX: Final = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
INT4_MAX: Final = 7  # symmetric absmax/7 keeps -8 unused by the quantizer, as compressed-tensors does

Array = jax.Array | np.ndarray


def check_fmt(fmt: str) -> str:
    """Returns `fmt` if it is a known runtime format, else raises ConfigError carrying it."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown weight format {fmt!r}; expected one of {FORMATS}", value=fmt, param="fmt")
    return fmt


def int4_group_size(w: Array, scale: Array) -> int:
    """Group size g of a runtime int4 pair: K = 2 * w.shape[-2], g = K // scale.shape[-2]."""
    k = 2 * w.shape[-2]
    groups = scale.shape[-2]
    if groups <= 0 or k % groups or (k // groups) % 2:
        raise ConfigError(f"int4 scale rows {groups} do not split K={k} into even-sized groups",
                          value=tuple(scale.shape), param="scale")
    return k // groups


def scale_tile(fmt: str, group_size: int) -> tuple[int, int]:
    """Stored weight elements per scale entry along (K, N) of a quantized `fmt`: FP8 128 x 128 tiles; INT4 groups
    of g along K are g // 2 packed bytes."""
    return (FP8_BLOCK, FP8_BLOCK) if check_fmt(fmt) == "fp8" else (group_size // 2, 1)


# --------------------------------------------------------------------------------------------- quantize


@jax.jit
def _fp8_quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., K, N] f32 -> (float8_e4m3fn [..., K, N], f32 [..., ceil(K/128), ceil(N/128)]), amax per tile."""
    *lead, k, n = w.shape
    gk, gn = math.ceil(k / FP8_BLOCK), math.ceil(n / FP8_BLOCK)
    pad = [(0, 0)] * len(lead) + [(0, gk * FP8_BLOCK - k), (0, gn * FP8_BLOCK - n)]
    tiles = jnp.pad(jnp.abs(w), pad).reshape(*lead, gk, FP8_BLOCK, gn, FP8_BLOCK)
    amax = tiles.max(axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)  # all-zero tile: any scale works
    expanded = _expand_fp8_scale(scale, k, n)
    # clip first: float8_e4m3fn has no inf, an out-of-range cast would give NaN
    q = jnp.clip(w / expanded, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q, scale


@functools.partial(jax.jit, static_argnames="group_size")
def _int4_quantize(w: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """[..., K, N] f32 -> (uint8 [..., K//2, N], bf16 [..., K//g, N]), symmetric absmax/7 per group along K."""
    *lead, k, n = w.shape
    if group_size <= 0 or group_size % 2 or k % group_size:
        raise ConfigError(f"int4 needs K={k} to be a multiple of an even group size, got {group_size}",
                          value=group_size, param="group_size")
    grouped = w.reshape(*lead, k // group_size, group_size, n)
    amax = jnp.abs(grouped).max(axis=-2)
    # round the scale to bf16 BEFORE dividing, so |W - dequant(W)| <= stored_scale / 2 holds exactly
    scale = jnp.where(amax > 0, amax / INT4_MAX, 1.0).astype(jnp.bfloat16)
    q = jnp.clip(jnp.round(grouped / scale.astype(jnp.float32)[..., None, :]), -8, 7).astype(jnp.int32)
    return pack_int4(q.reshape(*lead, k, n)), scale


def quantize(w: Array, fmt: str, group_size: int = 32) -> tuple[jax.Array, jax.Array | None]:
    """[K, N] or [E, K, N] float -> runtime `(w, scale)` in `fmt` (see the module table for layouts)."""
    check_fmt(fmt)
    w = jnp.asarray(w, jnp.float32)
    if w.ndim not in (2, 3):
        raise ConfigError(f"weights must be [K, N] or [E, K, N], got shape {w.shape}", value=w.shape, param="w")
    if fmt == "bf16":
        return w.astype(jnp.bfloat16), None
    if fmt == "f32":
        return w, None
    if fmt == "fp8":
        return _fp8_quantize(w)
    return _int4_quantize(w, group_size)


# ------------------------------------------------------------------------------------------- dequantize


@jax.jit
def pack_int4(q: jax.Array) -> jax.Array:
    """Signed int values [..., K, N] in [-8, 7] (K even) -> uint8 [..., K//2, N], even k in the low nibble."""
    *lead, k, n = q.shape
    nib = (q.astype(jnp.int32) + 8).reshape(*lead, k // 2, 2, n)
    return (nib[..., 0, :] | (nib[..., 1, :] << 4)).astype(jnp.uint8)


@jax.jit
def unpack_int4(w: jax.Array) -> jax.Array:
    """uint8 [..., K//2, N] -> int8 values [..., K, N] in [-8, 7]."""
    *lead, half, n = w.shape
    b = w.astype(jnp.int32)
    lo, hi = (b & 0xF) - 8, (b >> 4) - 8
    return jnp.stack([lo, hi], axis=-2).reshape(*lead, 2 * half, n).astype(jnp.int8)


def _expand_fp8_scale(scale: jax.Array, k: int, n: int) -> jax.Array:
    """Tile scales [..., ceil(K/128), ceil(N/128)] -> per-element [..., K, N] (edge tiles are partial)."""
    rep = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=-2), FP8_BLOCK, axis=-1)
    return rep[..., :k, :n]


@functools.partial(jax.jit, static_argnames="fmt")
def dequantize(w: Array, scale: Array | None, fmt: str) -> jax.Array:
    """Runtime `(w, scale)` in `fmt` -> f32 [..., K, N] (`...` is empty or the expert axis E)."""
    check_fmt(fmt)
    w = jnp.asarray(w)
    if fmt in ("bf16", "f32"):
        return w.astype(jnp.float32)
    if scale is None:
        raise ConfigError(f"format {fmt!r} needs a scale", value=None, param="scale")
    scale = jnp.asarray(scale)
    if fmt == "fp8":
        k, n = w.shape[-2:]
        want = (*w.shape[:-2], math.ceil(k / FP8_BLOCK), math.ceil(n / FP8_BLOCK))
        if tuple(scale.shape) != want:
            raise ConfigError(f"fp8 scale shape {scale.shape} != {want} for w {w.shape}",
                              value=tuple(scale.shape), param="scale")
        return w.astype(jnp.float32) * _expand_fp8_scale(scale.astype(jnp.float32), k, n)
    g = int4_group_size(w, scale)
    if tuple(scale.shape) != (*w.shape[:-2], 2 * w.shape[-2] // g, w.shape[-1]):
        raise ConfigError(f"int4 scale shape {scale.shape} does not match w {w.shape}",
                          value=tuple(scale.shape), param="scale")
    return unpack_int4(w).astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), g, axis=-2)


def weight_bytes(w: Array, scale: Array | None) -> int:
    """Bytes held by a runtime weight pair (packed weight plus scales)."""
    total = int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
    if scale is not None:
        total += int(np.prod(scale.shape)) * np.dtype(scale.dtype).itemsize
    return total


# ------------------------------------------------------------------------------------ HF conversions


def from_hf_fp8(weight: np.ndarray, scale_inv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF FP8 block: `weight` [out, in] float8_e4m3fn, `weight_scale_inv` [ceil(out/128), ceil(in/128)] f32
    -> runtime fp8 `(w [in, out] float8_e4m3fn, scale [ceil(in/128), ceil(out/128)] f32)`, bit-exact transposes."""
    out_dim, in_dim = weight.shape
    want = (math.ceil(out_dim / FP8_BLOCK), math.ceil(in_dim / FP8_BLOCK))
    if weight.dtype != ml_dtypes.float8_e4m3fn:
        raise CheckpointError(f"fp8 weight dtype {weight.dtype} is not float8_e4m3fn", value=str(weight.dtype),
                              param="weight")
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"weight_scale_inv shape {scale_inv.shape} != {want} for weight {weight.shape}",
                              value=tuple(scale_inv.shape), param="weight_scale_inv")
    return np.ascontiguousarray(weight.T), np.ascontiguousarray(scale_inv.astype(np.float32).T)


def from_hf_int4(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int] | np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """compressed-tensors pack-quantized: `weight_packed` [out, ceil(in/8)] int32, `weight_scale` [out, in/g] bf16,
    `weight_shape` (out, in) -> runtime int4 `(w [in//2, out] uint8, scale [in//g, out] bf16)`: nibbles are
    repacked, values and scales are unchanged. `in` must be a multiple of g (true for K2.x: 7168 and 2048, g=32)."""
    out_dim, in_dim = int(shape[0]), int(shape[1])
    if tuple(packed.shape) != (out_dim, math.ceil(in_dim / 8)):
        raise CheckpointError(f"weight_packed shape {packed.shape} != {(out_dim, math.ceil(in_dim / 8))}",
                              value=tuple(packed.shape), param="weight_packed")
    groups = scale.shape[1] if scale.ndim == 2 else 0
    if scale.ndim != 2 or scale.shape[0] != out_dim or groups == 0 or in_dim % groups or (in_dim // groups) % 2:
        raise CheckpointError(f"weight_scale shape {scale.shape} does not split in={in_dim} into even groups",
                              value=tuple(scale.shape), param="weight_scale")
    q = hf_formats.unpack_int4(packed, in_dim)  # [out, in] int8
    nib = (q.T.astype(np.int16) + 8).astype(np.uint8).reshape(in_dim // 2, 2, out_dim)
    w = (nib[:, 0, :] | (nib[:, 1, :] << 4)).astype(np.uint8)
    return np.ascontiguousarray(w), np.ascontiguousarray(scale.astype(ml_dtypes.bfloat16).T)


def to_hf_int4(w: Array, scale: Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runtime int4 `(w [K//2, N] uint8, scale [K//g, N] bf16)` -> compressed-tensors
    `(weight_packed [N, ceil(K/8)] int32, weight_scale [N, K//g] bf16, weight_shape [2] int32 = (N, K))`."""
    q = np.asarray(unpack_int4(jnp.asarray(w)))  # [K, N]
    packed = hf_formats.pack_int4(np.ascontiguousarray(q.T))
    return packed, np.ascontiguousarray(np.asarray(scale).astype(ml_dtypes.bfloat16).T), \
        np.array([q.shape[1], q.shape[0]], np.int32)


# --------------------------------------------------------------------------------- which tensors quantize


@dataclass(frozen=True)
class QuantRule:
    """A regex over NNX state paths (`layers.3.mlp.experts.gate`) and the kind of tensor it names.

    kind None means "never quantize"; the first matching rule wins.
    """

    pattern: str
    kind: str | None


# Order matters: exclusions first, so `layers.0.attn.q_a_norm` or `mlp.router` never reach a projection rule.
QUANT_RULES: Final[tuple[QuantRule, ...]] = (
    QuantRule(r"(^|\.)(embed|embed_tokens|lm_head)(\.|$)", None),
    QuantRule(r"norm", None),
    QuantRule(r"(^|\.)router(\.|$)", None),
    QuantRule(r"e_score_correction_bias", None),
    QuantRule(r"(^|\.)bias$", None),
    QuantRule(r"(^|\.)experts\.", "experts"),
    QuantRule(r"(^|\.)shared(_experts?)?\.", "shared_experts"),
    QuantRule(r"(^|\.)mlp\.(gate|up|down|gate_up)(\.|$)", "dense_mlp"),
    QuantRule(r"(^|\.)(attn|self_attn)\.", "attention"),
)


def quant_kind(param_path: str) -> str | None:
    """The kind of the first rule matching `param_path`, or None (not a quantizable tensor)."""
    for rule in QUANT_RULES:
        if re.search(rule.pattern, param_path):
            return rule.kind
    return None


# What each quantized format covers by default. INT4 follows Kimi K2-Thinking / K2.5 / K2.6's compressed-tensors recipe
# (its `ignore` list keeps attention, shared experts and the dense MLPs in BF16): routed experts only. FP8 follows
# the FP8 block checkpoints (DeepSeek-V3 / Kimi K2 / GLM): every MLP projection.
INT4_SCOPES: Final = {"experts": ("experts",), "mlps": ("experts", "shared_experts", "dense_mlp")}
FP8_KINDS: Final = ("experts", "shared_experts", "dense_mlp")


def check_int4_scope(scope: str) -> str:
    if scope not in INT4_SCOPES:
        raise ConfigError(f"int4_scope must be one of {sorted(INT4_SCOPES)}, got {scope!r}", value=scope,
                          param="int4_scope")
    return scope


def quantizable(param_path: str, fmt: str, *, attention: bool = False, int4_scope: str = "experts") -> bool:
    """Whether the tensor at `param_path` gets `fmt` ("fp8" | "int4"): FP8 for every MLP projection (routed,
    shared, dense); INT4 for the kinds of `int4_scope` ("experts": routed experts only, Kimi's INT4 recipe;
    "mlps": as FP8); attention projections too with `attention=True`; never embeddings, norms, router, biases,
    lm_head."""
    kind = quant_kind(param_path)
    kinds = INT4_SCOPES[check_int4_scope(int4_scope)] if fmt == "int4" else FP8_KINDS
    return kind in kinds or (attention and kind == "attention")
