"""Runtime FP8/INT4 formats: quantization error bounds, saturation, HF layout round trips, the quantizable rule;
the dense `ops.linear` on CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.errors import CheckpointError, ConfigError
from jaxserve.quant import formats, hf_formats, ops


def _weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal weights with per-column magnitudes spread over 1e-3..1e2 (tiles and groups differ in scale)."""
    mag = 10.0 ** rng.uniform(-3, 2, size=shape[:-2] + (1, shape[-1]))
    return (rng.standard_normal(shape) * mag).astype(np.float32)


@pytest.mark.parametrize("shape", [(200, 300), (3, 256, 128)])
def test_fp8_round_trip_bound(shape: tuple[int, ...]) -> None:
    # e4m3 keeps 3 mantissa bits: |q - fp8(q)| <= 2^-4 |q| for normal q (|q| >= 2^-6) and <= 2^-10 (half the
    # 2^-9 subnormal spacing) below; W = q * s with s = tile amax / 448, so per element
    # |W - deq| <= 2^-4 |W| + 2^-10 s, plus f32 rounding of w / s and q * s (the 1e-6 |W| slack).
    w = _weights(np.random.default_rng(1), shape)
    wq, scale = formats.quantize(w, "fp8")
    assert wq.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    assert scale.shape == (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    deq = np.asarray(formats.dequantize(wq, scale, "fp8"))
    s = np.asarray(formats._expand_fp8_scale(scale, shape[-2], shape[-1]))
    bound = 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * s + 1e-6 * np.abs(w)
    err = np.abs(deq - w)
    assert np.all(err <= bound), float((err / bound).max())
    assert np.all(np.isfinite(deq))


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_round_trip_bound(group_size: int) -> None:
    w = _weights(np.random.default_rng(2), (2, 256, 96))
    wq, scale = formats.quantize(w, "int4", group_size)
    assert wq.shape == (2, 128, 96) and wq.dtype == jnp.uint8
    assert scale.shape == (2, 256 // group_size, 96) and scale.dtype == jnp.bfloat16
    deq = np.asarray(formats.dequantize(wq, scale, "int4"))
    s = np.repeat(np.asarray(scale, np.float32), group_size, axis=-2)
    # rounding to the nearest multiple of the stored (bf16) scale: half a step, plus f32 rounding of w / s
    assert np.all(np.abs(deq - w) <= s / 2 * (1 + 1e-6))
    q = np.asarray(formats.unpack_int4(wq))
    assert q.min() >= -8 and q.max() <= 7


def test_saturation_and_zero_groups_give_no_nan() -> None:
    w = np.zeros((256, 256), np.float32)
    w[:128, :128] = np.random.default_rng(3).uniform(-1, 1, (128, 128)).astype(np.float32) * 3e38  # near f32 max
    w[0, 0], w[1, 1] = -3.4e38, 3.4e38
    w[200, 200] = 1e-30  # a tiny value alone in its tile / group
    for fmt in ("fp8", "int4"):
        wq, scale = formats.quantize(w, fmt, 32)
        deq = np.asarray(formats.dequantize(wq, scale, fmt))
        assert np.all(np.isfinite(deq)) and np.all(np.isfinite(np.asarray(scale, np.float32)))
        assert np.all(deq[128:, :128] == 0) and np.all(deq[:128, 128:200] == 0)  # all-zero tiles stay zero
        assert np.abs(deq[:128, :128] - w[:128, :128]).max() <= 0.5 * 3.4e38 / (7 if fmt == "int4" else 8)


def test_hf_int4_round_trips_are_exact() -> None:
    rng = np.random.default_rng(4)
    k, n, g = 256, 96, 32
    wq, scale = formats.quantize(_weights(rng, (k, n)), "int4", g)
    packed, hf_scale, shape = formats.to_hf_int4(wq, scale)
    assert packed.shape == (n, k // 8) and packed.dtype == np.int32 and tuple(shape) == (n, k)
    hf_deq = hf_formats.dequantize_pack_quantized(packed, hf_scale, tuple(shape), g)
    np.testing.assert_array_equal(hf_deq.T, np.asarray(formats.dequantize(wq, scale, "int4")))
    back_w, back_s = formats.from_hf_int4(packed, hf_scale, shape)
    np.testing.assert_array_equal(back_w, np.asarray(wq))
    np.testing.assert_array_equal(back_s.view(np.uint16), np.asarray(scale).view(np.uint16))

    # an HF checkpoint built by hf_formats' own quantizer (compressed-tensors byte layout), bf16 scales
    out_dim, in_dim = 160, 512
    q, s32 = hf_formats.quantize_int4_group(_weights(rng, (out_dim, in_dim)), 128)
    hf_packed, hf_s = hf_formats.pack_int4(q), s32.astype(ml_dtypes.bfloat16)
    rw, rs = formats.from_hf_int4(hf_packed, hf_s, (out_dim, in_dim))
    assert rw.shape == (in_dim // 2, out_dim) and rs.shape == (in_dim // 128, out_dim)
    np.testing.assert_array_equal(np.asarray(formats.dequantize(rw, rs, "int4")),
                                  hf_formats.dequantize_pack_quantized(hf_packed, hf_s, (out_dim, in_dim), 128).T)


def test_hf_fp8_conversion_is_exact() -> None:
    # 576 x 300: partial edge tiles on both axes, as the real kv_a_proj_with_mqa [576, 7168]
    w = _weights(np.random.default_rng(5), (576, 300))
    hf_w, hf_s = hf_formats.quantize_fp8_block(w)
    rw, rs = formats.from_hf_fp8(hf_w, hf_s)
    assert rw.shape == (300, 576) and rs.shape == (3, 5)
    np.testing.assert_array_equal(np.asarray(formats.dequantize(rw, rs, "fp8")),
                                  hf_formats.dequantize_fp8_block(hf_w, hf_s).T)


def test_bad_inputs_raise_typed_errors() -> None:
    w = np.ones((64, 32), np.float32)
    with pytest.raises(ConfigError) as e:
        formats.quantize(w, "int8")
    assert e.value.value == "int8" and e.value.param == "fmt"
    with pytest.raises(ConfigError) as e:
        formats.quantize(np.ones((48, 32), np.float32), "int4", 32)
    assert e.value.value == 32
    packed = hf_formats.pack_int4(np.zeros((8, 64), np.int8))
    with pytest.raises(CheckpointError) as e:
        formats.from_hf_int4(packed, np.ones((8, 2), ml_dtypes.bfloat16), (8, 72))
    assert e.value.value == (8, 8) and e.value.param == "weight_packed"
    with pytest.raises(CheckpointError):
        formats.from_hf_fp8(np.ones((4, 4), np.float32), np.ones((1, 1), np.float32))


def test_weight_bytes_for_a_k2_expert() -> None:
    # one K2 routed-expert gate/up projection: in 7168, out 2048 (shapes only, nothing is allocated)
    k, n = 7168, 2048
    int4 = formats.weight_bytes(jax.ShapeDtypeStruct((k // 2, n), jnp.uint8),
                                jax.ShapeDtypeStruct((k // 32, n), jnp.bfloat16))
    fp8 = formats.weight_bytes(jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
                               jax.ShapeDtypeStruct((k // 128, n // 128), jnp.float32))
    bf16 = formats.weight_bytes(jax.ShapeDtypeStruct((k, n), jnp.bfloat16), None)
    assert (int4, fp8, bf16) == (8_257_536, 14_683_648, 29_360_128)
    wq, scale = formats.quantize(np.ones((3, 64, 16), np.float32), "int4", 32)
    assert formats.weight_bytes(wq, scale) == 3 * 32 * 16 + 3 * 2 * 16 * 2


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 2 ** 31 - 1))
def test_pack_unpack_is_identity(half_k: int, n: int, seed: int) -> None:
    q = np.random.default_rng(seed).integers(-8, 8, size=(2 * half_k, n)).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(formats.unpack_int4(formats.pack_int4(jnp.asarray(q)))), q)


# (path, fp8, int4 default scope "experts", int4 scope "mlps"); attention=True adds the attention projections
@pytest.mark.parametrize("path, fp8, int4, int4_mlps", [
    ("layers.3.mlp.experts.gate", True, True, True),
    ("layers.3.mlp.experts.down", True, True, True),
    ("layers.3.mlp.shared.up", True, False, True),
    ("layers.3.mlp.shared_experts.down", True, False, True),
    ("layers.0.mlp.gate", True, False, True),
    ("layers.0.mlp.down", True, False, True),
    ("layers.0.attn.q_b", False, False, False),
    ("layers.0.attn.kv_a", False, False, False),
    ("layers.0.attn.o", False, False, False),
    ("layers.0.attn.q_a_norm", False, False, False),
    ("layers.0.attn.kv_a_norm.scale", False, False, False),
    ("layers.1.mlp.router", False, False, False),
    ("layers.1.mlp.router.e_score_correction_bias", False, False, False),
    ("layers.1.mlp.e_score_correction_bias", False, False, False),
    ("layers.1.input_norm", False, False, False),
    ("embed", False, False, False),
    ("embed.embedding", False, False, False),
    ("lm_head", False, False, False),
    ("final_norm", False, False, False),
])
def test_quantizable_rule(path: str, fp8: bool, int4: bool, int4_mlps: bool) -> None:
    assert formats.quantizable(path, "fp8") is fp8
    assert formats.quantizable(path, "int4") is int4
    assert formats.quantizable(path, "int4", int4_scope="mlps") is int4_mlps
    projection = ".attn." in path and "norm" not in path
    for fmt in ("fp8", "int4"):
        assert formats.quantizable(path, fmt, attention=True) is (formats.quantizable(path, fmt) or projection)


def test_unknown_int4_scope_is_refused() -> None:
    with pytest.raises(ConfigError, match="int4_scope") as e:
        formats.quantizable("layers.3.mlp.experts.gate", "int4", int4_scope="shared")
    assert e.value.value == "shared"


@pytest.mark.parametrize("rows", [1, 3])
def test_dense_linear_on_cpu_is_the_plain_f32_accumulated_dot(rows: int) -> None:
    """ops.linear computes one row as two only on GPU (XLA:GPU's strength reduction); on CPU every row count is
    the plain dot, bit for bit."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 384)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((384, 256)), jnp.bfloat16)
    want = jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    got = ops.linear(x, w, None, "bf16")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
