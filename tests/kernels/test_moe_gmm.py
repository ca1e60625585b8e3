"""Pallas grouped MoE matmul (interpret mode) vs dequantize + ragged_dot, its tile metadata,
`ops.grouped_linear` dispatch, and which XLA path `MoE.routed` takes at each size.

Tolerance as in test_int4_matmul: same bf16 activations on both sides, exactly dequantized weights (the tpu
int4 tiling rounds q * scale to bf16 once), f32 accumulation, bf16 output rounding: ||out - ref|| / ||ref||
<= 1e-2 (measured ~1.7e-3 gpu and fp8, ~2.2e-3 tpu int4). Rows past sum(group_sizes) must be exactly 0. The
gpu tiling runs in legacy `interpret=True`, the tpu tiling in TPU interpret mode.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.errors import ConfigError
from jaxserve.quant import formats, ops
from pallas_kernels.int4_matmul import KernelShapeError
from pallas_kernels.moe_gmm import GmmBlocks, moe_gmm, tile_layout
from pallas_kernels.moe_gmm_tpu import visit_layout
from pallas_kernels.reference import gmm_reference

REL_TOL = 1e-2
TPU = pltpu.InterpretParams()  # TPU interpret mode: runs the Mosaic-shaped (scalar-prefetch) kernel on CPU


def _rel_err(out: jax.Array, ref: jax.Array) -> float:
    ref = jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def _experts(rng: np.random.Generator, e: int, k: int, n: int, fmt: str, g: int) -> tuple[jax.Array, jax.Array]:
    w = rng.standard_normal((e, k, n)).astype(np.float32) * rng.uniform(0.1, 2.0, (e, 1, n)).astype(np.float32)
    return formats.quantize(w, fmt, g)


def _check(out: jax.Array, x: jax.Array, wq: jax.Array, scale: jax.Array, gs: np.ndarray, fmt: str) -> None:
    m, total = x.shape[0], int(gs.sum())
    assert out.dtype == x.dtype and out.shape[0] == m
    np.testing.assert_array_equal(np.asarray(out[total:], np.float32), 0.0)
    if total:
        ref = gmm_reference(x, wq, scale, jnp.asarray(gs), fmt)
        assert _rel_err(out[:total], ref[:total]) <= REL_TOL


@pytest.mark.parametrize("fmt, g", [("int4", 32), ("int4", 128), ("fp8", 128)])
@pytest.mark.parametrize("seed, m, group_sizes, blocks", [
    (0, 1, [0, 1, 0, 0], None),  # decode: one token, one non-empty expert
    (1, 7, [3, 0, 1, 0, 2, 0], None),  # empty groups, a group of size 1, sum 6 < M: last row is 0
    # groups spanning several tiles; gpu: 2 N blocks, tpu: 2 K steps carried in the VMEM accumulator
    (2, 64, [0, 20, 1, 30, 0, 0, 5, 1], {"gpu": GmmBlocks(16, 64), "tpu": GmmBlocks(16, 128, 128)}),
    (3, 256, [64, 0, 100, 1, 0, 91], None),  # prefill-sized
])
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_moe_gmm_matches_reference(backend: str, fmt: str, g: int, seed: int, m: int, group_sizes: list[int],
                                   blocks: dict[str, GmmBlocks] | None) -> None:
    rng = np.random.default_rng(seed * 7 + g)
    k, n = 256, 128
    gs = np.asarray(group_sizes, np.int32)
    wq, scale = _experts(rng, len(gs), k, n, fmt, g)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    out = moe_gmm(x, wq, scale, jnp.asarray(gs), fmt=fmt, blocks=(blocks or {}).get(backend), backend=backend,
                  interpret=TPU if backend == "tpu" else True)
    assert out.shape == (m, n)
    _check(out, x, wq, scale, gs, fmt)


def _random_packed(rng: np.random.Generator, e: int, k: int, n: int, fmt: str) -> tuple[jax.Array, jax.Array]:
    """Random weights straight in the runtime layout (quantizing [E, 7168, 2048] f32 would dominate the test)."""
    if fmt == "int4":
        w = rng.integers(0, 256, (e, k // 2, n), dtype=np.uint8)
        return jnp.asarray(w), jnp.asarray(rng.uniform(0.005, 0.02, (e, k // 32, n)), jnp.bfloat16)
    b = rng.integers(0, 256, (e, k, n), dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0  # the e4m3fn NaN codes
    return (jnp.asarray(b.view(ml_dtypes.float8_e4m3fn)),
            jnp.asarray(rng.uniform(1e-4, 1e-3, (e, k // 128, -(-n // 128))), jnp.float32))


@functools.lru_cache(maxsize=1)
def _real_dims_case(fmt: str, k: int, n: int) -> tuple[jax.Array, jax.Array, jax.Array, np.ndarray, jax.Array]:
    """(x [6, k] bf16, w, scale, group_sizes [2], reference [6, n] f32), built once per shape for both backends."""
    rng = np.random.default_rng(k + n)
    gs = np.asarray([3, 2], np.int32)  # five rows of six: the last row must come out 0
    wq, scale = _random_packed(rng, len(gs), k, n, fmt)
    x = jnp.asarray(rng.standard_normal((6, k)), jnp.bfloat16)
    return x, wq, scale, gs, gmm_reference(x, wq, scale, jnp.asarray(gs), fmt)


_SLOW = pytest.mark.slow  # each ~10-25 s on the shared 2-core host (reference + interpret over 7168 x 2048)


@pytest.mark.parametrize("fmt, k, n, backend", [
    ("int4", 7168, 2048, "gpu"),  # Kimi K2.6 gate/up: hidden 7168 -> expert FFN 2048, INT4 g32
    ("int4", 7168, 2048, "tpu"),
    ("fp8", 7168, 2048, "tpu"),
    pytest.param("fp8", 7168, 2048, "gpu", marks=_SLOW),
    pytest.param("int4", 2048, 7168, "gpu", marks=_SLOW),  # down projection (the transposed shape)
    pytest.param("int4", 2048, 7168, "tpu", marks=_SLOW),
    pytest.param("fp8", 2048, 7168, "gpu", marks=_SLOW),
    pytest.param("fp8", 2048, 7168, "tpu", marks=_SLOW),
])
def test_moe_gmm_real_dims(fmt: str, k: int, n: int, backend: str) -> None:
    # the default blocks of each backend at the real K and N (tpu: K tiled 1024, N 1024; gpu: 224 g32 groups)
    x, wq, scale, gs, ref = _real_dims_case(fmt, k, n)
    out = moe_gmm(x, wq, scale, jnp.asarray(gs), fmt=fmt, backend=backend,
                  interpret=TPU if backend == "tpu" else True)
    np.testing.assert_array_equal(np.asarray(out[5:], np.float32), 0.0)
    assert _rel_err(out[:5], ref[:5]) <= REL_TOL


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_moe_gmm_random_ragged_groups_and_all_empty(backend: str) -> None:
    # tpu: unused tiles skip compute and leave their rows unwritten (NaN in interpret mode); none may leak
    mode = TPU if backend == "tpu" else True
    rng = np.random.default_rng(11)
    e, k, n, m = 8, 128, 96, 40
    gs = rng.multinomial(m - 3, rng.dirichlet(np.full(e, 0.3))).astype(np.int32)  # sum 37 < M
    for fmt in ("int4", "fp8"):
        wq, scale = _experts(rng, e, k, n, fmt, 32)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        out = moe_gmm(x, wq, scale, jnp.asarray(gs), fmt=fmt, backend=backend, interpret=mode)
        _check(out, x, wq, scale, gs, fmt)
        empty = np.zeros(e, np.int32)
        out = moe_gmm(x, wq, scale, jnp.asarray(empty), fmt=fmt, backend=backend, interpret=mode)
        _check(out, x, wq, scale, empty, fmt)


_jit_tile_layout = jax.jit(tile_layout, static_argnums=(1, 2))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=9, max_size=9), st.sampled_from([4, 8, 16]))
def test_tile_layout_puts_each_row_in_one_single_expert_tile(sizes: list[int], block_m: int) -> None:
    # fixed E = 9 and M = 64 (sum <= 63 < M) keep one compile per block_m; zeros anywhere are empty groups
    gs = np.asarray(sizes, np.int32)
    m = 64
    lay = _jit_tile_layout(jnp.asarray(gs), m, block_m)
    row_src, row_valid = np.asarray(lay.row_src), np.asarray(lay.row_valid)
    tile_group, row_dst, out_valid = np.asarray(lay.tile_group), np.asarray(lay.row_dst), np.asarray(lay.out_valid)
    group_of_row = np.repeat(np.arange(len(gs)), gs)
    total = int(gs.sum())
    np.testing.assert_array_equal(out_valid, np.arange(m) < total)
    # every real row lands once, in a tile owned by its own expert, and comes back to where it started
    np.testing.assert_array_equal(np.sort(row_src[row_valid]), np.arange(total))
    np.testing.assert_array_equal(row_src[row_dst[:total]], np.arange(total))
    assert np.all(row_valid[row_dst[:total]])
    np.testing.assert_array_equal(tile_group[row_dst[:total] // block_m], group_of_row)
    # exactly the tiles holding a row have an expert; the rest are -1 (written as zeros, skipped)
    used = np.zeros(len(tile_group), bool)
    used[row_dst[:total] // block_m] = True
    np.testing.assert_array_equal(tile_group >= 0, used)
    assert len(tile_group) == -(-m // block_m) + min(len(gs), m)  # the static tile bound


_jit_visit_layout = jax.jit(visit_layout, static_argnums=(1, 2))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=9, max_size=9), st.sampled_from([8, 16]))
def test_visit_layout_writes_each_row_once_and_revisits_tiles_only_in_a_row(sizes: list[int], block_m: int) -> None:
    # the tpu tiling's visits over M = 64 rows, E = 9 (sums past 64 are clipped by dropping the last groups)
    m = 64
    gs = np.asarray(sizes, np.int32)
    gs[np.cumsum(gs) > m] = 0
    lay = _jit_visit_layout(jnp.asarray(gs), m, block_m)
    tile, group, lo, hi, first = (np.asarray(a) for a in (lay.tile, lay.group, lay.lo, lay.hi, lay.first))
    used = group >= -1
    assert len(tile) == m // block_m + min(len(gs), m)  # the static visit bound
    assert np.all(used[:used.sum()]) and np.all(np.diff(tile) >= 0)  # used visits first; tiles never go back
    # each row is written by exactly one expert visit, of its own expert, or (past the sum) zeroed by a tile's first
    writers = np.zeros(m, int)
    owner = np.full(m, -1)
    for v in np.flatnonzero(group >= 0):
        rows = np.arange(tile[v] * block_m, (tile[v] + 1) * block_m)
        mine = rows[(rows >= lo[v]) & (rows < hi[v])]
        writers[mine] += 1
        owner[mine] = group[v]
        assert len(mine) and lo[v] == np.cumsum(gs)[group[v]] - gs[group[v]] and hi[v] - lo[v] == gs[group[v]]
    total = int(gs.sum())
    np.testing.assert_array_equal(writers, (np.arange(m) < total).astype(int))
    np.testing.assert_array_equal(owner[:total], np.repeat(np.arange(len(gs)), gs))
    # every tile gets exactly one first visit (which starts it from 0), among the used visits
    np.testing.assert_array_equal(np.sort(tile[first == 1]), np.arange(m // block_m))
    assert not np.any(first[~used])
    # non-expert visits read the last expert visit's x tile and weights: no new DMA
    experts = np.flatnonzero(group >= 0)
    if len(experts):
        last = experts[-1]
        assert np.all(lay.x_tile[last:] == lay.x_tile[last]) and np.all(lay.w_group[last:] == lay.w_group[last])


@pytest.mark.parametrize("fmt", ["bf16", "f32", "fp8", "int4"])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_grouped_linear_dispatch_matches_reference(fmt: str, use_kernel: bool) -> None:
    rng = np.random.default_rng(hash((fmt, use_kernel, "grouped")) % 2 ** 32)
    gs = np.asarray([5, 0, 1, 9, 0], np.int32)
    m, k, n = 18, 256, 64  # sum 15 < 18: three zero rows
    wq, scale = _experts(rng, len(gs), k, n, fmt, 32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    out = ops.grouped_linear(x, wq, scale, jnp.asarray(gs), fmt, use_kernel=use_kernel, interpret=True)
    assert out.shape == (m, n)
    _check(out, x, wq, scale, gs, fmt)


@pytest.mark.parametrize("m, group_sizes", [
    (1024, [300, 0, 1, 127, 128, 129, 200, 100]),  # prefill-sized: 128-row tiles, groups around a tile edge
    (512, [0, 0, 0, 512, 0, 0, 0, 0]),  # every row in one expert
])
def test_xla_grouped_matmul_at_prefill_sizes(m: int, group_sizes: list[int]) -> None:
    rng = np.random.default_rng(m)
    gs = np.asarray(group_sizes, np.int32)
    assert ops.xla_tile_rows(m, len(gs)) > ops.XLA_MIN_TILE_ROWS  # the large-tile case is the one under test
    wq, scale = _experts(rng, len(gs), 128, 64, "int4", 32)
    x = jnp.asarray(rng.standard_normal((m, 128)), jnp.bfloat16)
    _check(ops.grouped_linear(x, wq, scale, jnp.asarray(gs), "int4"), x, wq, scale, gs, "int4")


def test_xla_tile_rows_follow_the_mean_group() -> None:
    assert ops.xla_tile_rows(32, 8) == ops.XLA_MIN_TILE_ROWS  # decode at batch 16, top-2: tiny groups
    assert ops.xla_tile_rows(1024, 8) == ops.XLA_MAX_TILE_ROWS  # a 512-token prefill step
    assert ops.xla_tile_rows(512, 8) == 64
    assert ops.xla_tile_rows(2048 * 8, 384) == 32  # Kimi's 384 experts at 2048 tokens


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moe_routed_paths_agree_and_follow_the_size(dtype) -> None:
    """8 experts, top-2: 2 and 4 tokens (no more pairs than experts: a c = 1 verify's 4) gather their experts, 8 go
    through every expert (64 rows < 8 tiles of 16), 16 and 32 fill expert slots (one batched product per projection,
    the grouped tile loop under a cond for pairs past a slot's capacity); each equals the tile loop run directly."""
    import hf_tiny
    from flax import nnx

    from jaxserve.config import from_hf_config
    from jaxserve.models.layers import MoE

    cfg = from_hf_config(hf_tiny.CONFIGS["deepseek_v3"]().to_dict())
    moe = MoE(cfg, dtype=dtype, rngs=nnx.Rngs(1), path="layers.1.mlp")
    graphdef, state = nnx.split(moe)

    def routed(state: nnx.State, x: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, state)
        w, ids = m.route(x)
        return m.routed(x, w, ids, 0)

    def tiles(state: nnx.State, x: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, state)
        w, ids = m.route(x)
        n, k = ids.shape
        order = jnp.argsort(ids.reshape(-1), stable=True)
        token = (jnp.arange(n * k) // k)[order]
        y = m.experts(x[token], jnp.bincount(ids.reshape(-1), length=8).astype(jnp.int32))
        return jnp.zeros((n, x.shape[1]), jnp.float32).at[token].add(y.astype(jnp.float32) *
                                                                    w.reshape(-1)[order][:, None])

    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # bf16: roundings apart (measured 0.7% gathered, 0.3% dense)
    for n, loop in ((2, False), (4, False), (8, False), (16, True), (32, True)):
        x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size), dtype)
        got, want = jax.jit(routed)(state, x), jax.jit(tiles)(state, x)
        assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= tol, n
        text = jax.jit(routed).lower(state, x).as_text()
        assert ("while" in text) == loop and ("stablehlo.case" in text or "stablehlo.if" in text) == loop, n


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moe_gate_up_twin_runs_every_expert_as_two_dimensional_products(dtype) -> None:
    """Experts holding the gate_up twin (`MatmulFormat.gate_up`, the CPU compute layout): the twin is gate and up's
    own values; 2 and 4 tokens still gather their experts, 8 to GATE_UP_ROWS tokens run dense_all off the twin (one
    [N, H] x [H, 2 * E * I] product and the down projection, no batched product, loop or cond), more fill the
    slots; each equals the same block without the twin (f32: to rounding; bf16: within its roundings)."""
    import hf_tiny
    from flax import nnx

    from jaxserve.config import from_hf_config
    from jaxserve.models import layers
    from jaxserve.quant.weight_format import WeightPlan

    cfg = from_hf_config(hf_tiny.CONFIGS["deepseek_v3"]().to_dict())
    plain = layers.MoE(cfg, dtype=dtype, rngs=nnx.Rngs(1), path="layers.1.mlp")
    twin = layers.MoE(cfg, dtype=dtype, rngs=nnx.Rngs(1), path="layers.1.mlp", weights=WeightPlan(gate_up=True))
    assert plain.experts.gate_up is None
    e, h, i = twin.experts.gate.shape
    np.testing.assert_array_equal(np.asarray(twin.experts.gate[...]), np.asarray(plain.experts.gate[...]))
    gu = np.asarray(twin.experts.gate_up[...].astype(jnp.float32))  # [H, 2, E, I]
    assert gu.shape == (h, 2, e, i)
    np.testing.assert_array_equal(gu[:, 0], np.asarray(twin.experts.gate[...].astype(jnp.float32)).transpose(1, 0, 2))
    np.testing.assert_array_equal(gu[:, 1], np.asarray(twin.experts.up[...].astype(jnp.float32)).transpose(1, 0, 2))

    def routed(moe: layers.MoE, x: jax.Array) -> jax.Array:
        w, ids = moe.route(x)
        return moe.routed(x, w, ids, 0)

    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for n in (2, 4, 8, 16, layers.GATE_UP_ROWS, 2 * layers.GATE_UP_ROWS):
        x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size), dtype)
        got, want = jax.jit(routed, static_argnums=0)(twin, x), jax.jit(routed, static_argnums=0)(plain, x)
        assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= tol, n
        text = jax.jit(routed, static_argnums=0).lower(twin, x).as_text()
        wide = re.search(rf"dot_general.*-> tensor<{n}x{2 * e * i}x", text) is not None
        batched = re.search(r"dot_general[^\n]*batching_dims", text) is not None
        cond = "stablehlo.case" in text or "stablehlo.if" in text
        if n * 2 <= e:  # gathered, as without the twin
            assert not wide and not cond, n
        elif n <= layers.GATE_UP_ROWS:
            assert wide and not batched and not cond and "while" not in text, n
        else:  # the slots, the tile loop under a cond
            assert not wide and batched and cond, n


def test_moe_slots_equal_the_tile_loop_past_capacity_and_for_experts_elsewhere() -> None:
    """MoE.routed_by_slots: pairs past an expert's capacity (skewed routing: every token on experts 0 and 1) go
    through the grouped tile loop, pairs routed to experts held elsewhere (EP: local id E) add nothing; in f32 it
    equals routed_by_groups at every capacity. The bound: a shape whose slots pass SLOTS_MAX_ELEMENTS (a real
    model's prefill) keeps the tile loop alone."""
    import hf_tiny
    from flax import nnx

    from jaxserve.config import from_hf_config
    from jaxserve.models import layers

    cfg = from_hf_config(hf_tiny.CONFIGS["deepseek_v3"]().to_dict())
    moe = layers.MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(2), path="layers.1.mlp")
    e = moe.experts.gate.shape[0]
    n, k = 16, 2
    x = jax.random.normal(jax.random.key(3), (n, cfg.hidden_size), jnp.float32)
    w = jax.nn.softmax(jax.random.normal(jax.random.key(4), (n, k)), axis=-1)
    token = jnp.arange(n * k, dtype=jnp.int32) // k
    rng = np.random.default_rng(5)
    cases = {"balanced": rng.integers(0, e, n * k), "skewed": np.tile([0, 1], n),
             "elsewhere": np.where(rng.random(n * k) < 0.4, e, rng.integers(0, e, n * k))}
    for name, ids in cases.items():
        local = jnp.asarray(ids, jnp.int32)
        want = moe.routed_by_groups(x, w, token, local)
        for cap in (1, 2, layers.slot_capacity(n * k, e), n * k):
            got = moe.routed_by_slots(x, w, token, local, w.reshape(-1), cap)
            assert float(jnp.max(jnp.abs(got - want))) <= 1e-6 * float(jnp.max(jnp.abs(want))), (name, cap)
    assert layers.slot_capacity(32, 8) == 8 and layers.slot_capacity(2, 8) == 2 and layers.slot_capacity(9, 8) == 4
    widest = max(moe.experts.gate.shape[1:])
    big = 4 * layers.SLOTS_MAX_ELEMENTS // (e * widest)  # tokens whose slots (capacity ~ twice the mean) pass it
    assert e * layers.slot_capacity(k * big, e) * widest > layers.SLOTS_MAX_ELEMENTS
    xb = jnp.zeros((big, cfg.hidden_size), jnp.float32)
    wb, ids = jax.eval_shape(moe.route, xb)
    text = jax.jit(lambda x, w, i: moe.routed(x, w, i, 0)).lower(
        xb, jnp.zeros(wb.shape, wb.dtype), jnp.zeros(ids.shape, ids.dtype)).as_text()
    assert "while" in text and "stablehlo.case" not in text and "stablehlo.if" not in text


def test_bad_format_and_shapes_raise_typed_errors() -> None:
    x = jnp.ones((4, 64), jnp.bfloat16)
    w = jnp.ones((2, 64, 8), jnp.bfloat16)
    with pytest.raises(KernelShapeError) as e:
        moe_gmm(x, w, jnp.ones((2, 1, 1)), jnp.asarray([2, 2], jnp.int32), fmt="bf16", interpret=True)
    assert e.value.value == "bf16" and e.value.param == "fmt"
    with pytest.raises(ConfigError) as e:
        ops.grouped_linear(x, w, None, jnp.asarray([4], jnp.int32), "bf16")
    assert e.value.value == (2, 64, 8)
    wq, scale = formats.quantize(np.ones((2, 64, 8), np.float32), "fp8")
    with pytest.raises(KernelShapeError, match="128"):  # fp8 kernel needs K % 128 == 0 (ops falls back to XLA)
        moe_gmm(x, wq, scale, jnp.asarray([2, 2], jnp.int32), fmt="fp8", interpret=True)
    wq, scale = formats.quantize(np.ones((2, 256, 128), np.float32), "int4", 32)
    x = jnp.ones((4, 256), jnp.bfloat16)
    gs = jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(KernelShapeError) as e:  # tpu blocks must tile K in whole scale groups
        moe_gmm(x, wq, scale, gs, fmt="int4", blocks=GmmBlocks(16, 128, 96), backend="tpu", interpret=TPU)
    assert e.value.param == "blocks"
    with pytest.raises(KernelShapeError) as e:
        moe_gmm(x, wq, scale, gs, fmt="int4", backend="mosaic")
    assert e.value.value == "mosaic" and e.value.param == "backend"


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_rows_read_the_tokens_in_place(backend: str) -> None:
    """moe_gmm(x, rows=r) equals moe_gmm(x[r]): rows name each sorted row's token (repeats, any order, fewer tokens
    than rows); grouped_linear's XLA path takes the same rows."""
    rng = np.random.default_rng(7)
    gs = np.asarray([3, 0, 5, 2], np.int32)
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
    rows = jnp.asarray(rng.integers(0, 4, 11), jnp.int32)  # 11 sorted rows (sum 10: the last is 0)
    wq, scale = _experts(rng, len(gs), 128, 64, "int4", 32)
    interp = True if backend == "gpu" else TPU
    run = functools.partial(moe_gmm, w=wq, scale=scale, group_sizes=jnp.asarray(gs), fmt="int4", backend=backend,
                            interpret=interp)
    got, want = run(x, rows=rows), run(x[rows])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    xla = ops.grouped_linear(x, wq, scale, jnp.asarray(gs), "int4", rows=rows)
    _check(xla, x[rows], wq, scale, gs, "int4")
