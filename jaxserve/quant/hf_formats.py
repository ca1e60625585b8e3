"""The quantized weight layouts real checkpoints ship, in NumPy (used by the converter and its tests).

- FP8 e4m3 with 128x128 block scales (DeepSeek-V3, Kimi K2): `weight` [out, in] float8_e4m3fn and
  `weight_scale_inv` [ceil(out/b), ceil(in/b)] float32; W = float(Wq) * scale_inv[i // b, j // b].
- compressed-tensors `pack-quantized` INT4 (Kimi K2-Thinking / K2.5 / K2.6): `weight_packed` [out, ceil(in/8)]
  int32 (nibble q+8, element k in word k // 8 at bit 4*(k % 8)), `weight_scale` [out, ceil(in/g)] bf16,
  `weight_shape` [2] int32; W[o, i] = (nibble - 8) * scale[o, i // g].
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP8_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


def _block_expand(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """Scale grid [ceil(out/bo), ceil(in/bi)] -> per-element [out, in] (edge tiles are partial)."""
    bo, bi = block
    return np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[: shape[0], : shape[1]]


def dequantize_fp8_block(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """[out, in] float8_e4m3fn x [ceil(out/b), ceil(in/b)] f32 -> [out, in] f32."""
    out_dim, in_dim = weight.shape
    want = (math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1]))
    if scale_inv.shape != want:
        raise ValueError(f"weight_scale_inv shape {scale_inv.shape} != expected {want} for weight {weight.shape}")
    return weight.astype(np.float32) * _block_expand(scale_inv.astype(np.float32), weight.shape, block)


def quantize_fp8_block(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (float8_e4m3fn [out, in], scale_inv f32 [ceil(out/b), ceil(in/b)]), amax per tile."""
    out_dim, in_dim = w.shape
    bo, bi = block
    go, gi = math.ceil(out_dim / bo), math.ceil(in_dim / bi)
    padded = np.zeros((go * bo, gi * bi), np.float32)
    padded[:out_dim, :in_dim] = np.abs(w.astype(np.float32))
    amax = padded.reshape(go, bo, gi, bi).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).astype(np.float32)
    q = np.clip(w.astype(np.float32) / _block_expand(scale_inv, w.shape, block), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.astype(ml_dtypes.float8_e4m3fn), scale_inv


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Signed int4 values [out, in] in [-8, 7] -> int32 words [out, ceil(in/8)] (compressed-tensors layout)."""
    if q.min(initial=0) < -8 or q.max(initial=0) > 7:
        raise ValueError("int4 values must lie in [-8, 7]")
    rows, cols = q.shape
    n_words = math.ceil(cols / 8)
    nib = np.zeros((rows, n_words * 8), np.uint32)
    nib[:, :cols] = (q.astype(np.int32) + 8).astype(np.uint32)
    # padding nibbles stay 0, as compressed-tensors pads after the +8 offset
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, None, :]
    words = np.bitwise_or.reduce(nib.reshape(rows, n_words, 8) << shifts, axis=-1)
    return words.astype(np.uint32).view(np.int32)


def unpack_int4(packed: np.ndarray, cols: int) -> np.ndarray:
    """int32 words [out, ceil(cols/8)] -> signed int8 values [out, cols]."""
    words = packed.astype(np.int32).view(np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, None, :]
    nib = (words[:, :, None] >> shifts) & np.uint32(0xF)
    return (nib.reshape(packed.shape[0], -1)[:, :cols].astype(np.int16) - 8).astype(np.int8)


def quantize_int4_group(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (int8 values in [-8, 7] [out, in], scales f32 [out, ceil(in/g)]); symmetric absmax/7."""
    out_dim, in_dim = w.shape
    g = math.ceil(in_dim / group_size)
    padded = np.zeros((out_dim, g * group_size), np.float32)
    padded[:, :in_dim] = w.astype(np.float32)
    grouped = padded.reshape(out_dim, g, group_size)
    scale = np.abs(grouped).max(axis=-1) / 7.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(grouped / scale[:, :, None]), -8, 7).astype(np.int8).reshape(out_dim, -1)[:, :in_dim]
    return q, scale


def dequantize_int4_group(q: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """int8 values [out, in] x scales [out, ceil(in/g)] -> f32 [out, in]."""
    in_dim = q.shape[1]
    return q.astype(np.float32) * np.repeat(scale.astype(np.float32), group_size, axis=1)[:, :in_dim]


def pack_int8(q: np.ndarray) -> np.ndarray:
    """Signed int8 values [out, in] -> int32 words [out, ceil(in/4)] (compressed-tensors pack-quantized, 8 bits:
    value + 128 per byte, lowest byte first)."""
    rows, cols = q.shape
    n_words = math.ceil(cols / 4)
    b = np.zeros((rows, n_words * 4), np.uint32)
    b[:, :cols] = (q.astype(np.int32) + 128).astype(np.uint32)
    shifts = (8 * np.arange(4, dtype=np.uint32))[None, None, :]
    return np.bitwise_or.reduce(b.reshape(rows, n_words, 4) << shifts, axis=-1).astype(np.uint32).view(np.int32)


def unpack_int8(packed: np.ndarray, cols: int) -> np.ndarray:
    """int32 words [out, ceil(cols/4)] -> signed int8 values [out, cols]."""
    words = packed.astype(np.int32).view(np.uint32)
    shifts = (8 * np.arange(4, dtype=np.uint32))[None, None, :]
    b = (words[:, :, None] >> shifts) & np.uint32(0xFF)
    return (b.reshape(packed.shape[0], -1)[:, :cols].astype(np.int16) - 128).astype(np.int8)


def dequantize_pack_quantized(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int],
                              group_size: int | None, num_bits: int = 4) -> np.ndarray:
    """compressed-tensors pack-quantized INT4 or INT8 -> f32 [out, in]. group_size None: one scale per output
    channel (strategy "channel", scale [out, 1])."""
    out_dim, in_dim = int(shape[0]), int(shape[1])
    per_word = 32 // num_bits
    if packed.shape != (out_dim, math.ceil(in_dim / per_word)):
        raise ValueError(f"weight_packed shape {packed.shape} != expected {(out_dim, math.ceil(in_dim / per_word))}")
    q = unpack_int4(packed, in_dim) if num_bits == 4 else unpack_int8(packed, in_dim)
    return dequantize_int(q, scale, group_size)


def dequantize_int(q: np.ndarray, scale: np.ndarray, group_size: int | None) -> np.ndarray:
    """Integer values [out, in] x scales [out, ceil(in/g)] (or [out, 1] per channel when group_size is None)."""
    out_dim, in_dim = q.shape
    g = in_dim if group_size is None else group_size
    if scale.shape != (out_dim, math.ceil(in_dim / g)):
        raise ValueError(f"weight_scale shape {scale.shape} != expected {(out_dim, math.ceil(in_dim / g))} for "
                         + ("per-channel scales" if group_size is None else f"group size {group_size}"))
    return dequantize_int4_group(q, scale, g)
