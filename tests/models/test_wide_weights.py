"""f32 twins of bf16 Linear weights (`MatmulFormat.wide`, the CPU compute layout): one-row products read the twin,
so XLA:CPU converts no weight per call, and every output is the bf16 weights' own, bit for bit. The routed experts
hold none (their gathers convert only the gathered experts). The routed experts' gate_up twin (`MatmulFormat.gate_up`)
holds their gate and up values as one row-major weight."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import hf_tiny
from jaxserve.config import from_hf_config
from jaxserve.models import CausalLM, forward
from jaxserve.models.layers import Experts, Linear
from jaxserve.quant.apply import compute_layout, quantize_model
from jaxserve.quant.weight_format import MatmulFormat, WeightFormat


@pytest.fixture(scope="module")
def bf16_model():
    cfg = from_hf_config(hf_tiny.CONFIGS["deepseek_v3"]().to_dict())
    return CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(5))


def test_twins_hold_the_weights_values(bf16_model):
    wide = compute_layout(bf16_model, jnp.bfloat16, wide=True)
    linears = [m for _, m in nnx.iter_graph(wide) if isinstance(m, Linear)]
    experts = [m for _, m in nnx.iter_graph(wide) if isinstance(m, Experts)]
    assert linears and experts
    for m in linears:
        assert m.fmt == "bf16" and m.wide[...].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(m.wide[...]), np.asarray(m.weight[...].astype(jnp.float32)))
    for m in experts:  # no f32 copy: every array is the bf16 weights'
        assert {v.get_value().dtype for _, v in nnx.to_flat_state(nnx.state(m))} == {jnp.dtype(jnp.bfloat16)}
    assert all(m.wide is None for _, m in nnx.iter_graph(compute_layout(bf16_model, jnp.bfloat16))
               if isinstance(m, Linear))  # off unless asked


@pytest.mark.parametrize("rows", [1, pytest.param(3, marks=pytest.mark.slow)])  # 3: the bf16 path (CI time)
def test_logits_equal_without_twins(bf16_model, rows):
    """One token per row (rows = 1: every dense product reads its twin, the experts are gathered in bf16) and three
    rows (the bf16 weights): the logits are bitwise those of the model without twins."""
    tokens = jnp.asarray(np.random.default_rng(rows).integers(0, 256, (rows, 1)), jnp.int32)
    plain = forward(compute_layout(bf16_model, jnp.bfloat16), tokens)
    wide = forward(compute_layout(bf16_model, jnp.bfloat16, wide=True), tokens)
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(plain))


def test_a_one_row_product_converts_no_weight():
    """The one-row linear of a bf16 weight converts the whole weight to f32 on XLA:CPU (negative control); with
    its twin it converts only the row."""
    def converts(wide: bool) -> list[str]:
        lin = Linear(256, 512, axes=(None, None), dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                     fmt=MatmulFormat(wide=wide))
        graphdef, state = nnx.split(lin)
        x = jnp.ones((1, 256), jnp.bfloat16)
        hlo = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)).lower(state, x).compile().as_text()
        return [ln for ln in hlo.splitlines() if re.search(r"convert\S* = f32\[256,512\]", ln)]

    if jax.default_backend() != "cpu":
        pytest.skip("the convert is XLA:CPU's")
    assert converts(False)
    assert not converts(True)


@pytest.mark.parametrize("rows", [1, 2, 4])  # decode at c = 1; decode at 2 rows; the c = 1 verify's k + 1 = 4 positions
def test_only_products_of_up_to_wide_rows_rows_read_the_twin(rows):
    """Which weight a product reads, by its row count: the f32 twin up to `WIDE_ROWS` rows, the bf16 weight above
    (from 2 rows on XLA:CPU's bf16 dot measured faster than the twin's f32 one, in the decode and the c = 1 verify
    alike: bench/step_cuts.py variants now vs wide64). jit drops the parameter the program does not read."""
    from jaxserve.models import layers

    lin = Linear(256, 512, axes=(None, None), dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fmt=MatmulFormat(wide=True))
    graphdef, state = nnx.split(lin)
    x = jnp.ones((1, rows, 256), jnp.bfloat16)  # [B, T, H]: a verify chunk's layout
    hlo = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)).lower(state, x).compile().as_text()
    entry = hlo[hlo.index("\nENTRY "):]
    read = {t for t in ("f32", "bf16") if re.search(rf"= {t}\[256,512\]\S* parameter\(", entry)}
    assert read == ({"f32"} if rows <= layers.WIDE_ROWS else {"bf16"})


def test_gate_up_twin_holds_the_dequantized_values(bf16_model):
    """compute_layout(gate_up=True) from INT4 experts: each block's twin is its dequantized gate and up, exactly
    (`Experts.gate_up_of`); off unless asked; the logits of 8 rows (dense_all off the twin) equal the model's
    without it to within the roundings of another accumulation order."""
    int4 = quantize_model(bf16_model, WeightFormat("int4"))
    twin = compute_layout(int4, jnp.bfloat16, gate_up=True)
    plain = compute_layout(int4, jnp.bfloat16)
    experts = [m for _, m in nnx.iter_graph(twin) if isinstance(m, Experts)]
    assert experts and all(m.fmt == "bf16" for m in experts)
    for m in experts:
        np.testing.assert_array_equal(np.asarray(m.gate_up[...].astype(jnp.float32)),
                                      np.asarray(Experts.gate_up_of(m.gate[...], m.up[...]).astype(jnp.float32)))
    assert all(m.gate_up is None for _, m in nnx.iter_graph(plain) if isinstance(m, Experts))
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 256, (8, 1)), jnp.int32)
    got, want = (np.asarray(forward(m, tokens).astype(jnp.float32)) for m in (twin, plain))
    assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))
