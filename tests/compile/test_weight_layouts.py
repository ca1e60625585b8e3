"""Weights a TPU holds in the layout its compiled programs read (jaxserve.sharding.param_format / state_formats),
compiled by XLA:TPU + Mosaic for v6e:2x4 at the per-device widths of GLM-5.2 over 32 v6e chips (8 devices, a
quarter of the heads and FFN): the absorbed MLA projections read kv_b [N*(dn+dv), r] as it lies (2 heads a chip),
and the FP8 shared expert's 64-wide gate / up shards go to the Mosaic FP8 kernel row-major. Each case's control
compiles the same block with the default layouts (state_shardings): XLA:TPU copies those weights on every call."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

from aot import NoPool
from jaxserve.config import from_hf_config
from jaxserve.models.attention import MLAttention
from jaxserve.models.layers import MoE
from jaxserve.plan import PRESETS
from jaxserve.plan_compile import _tracked_shapes, moves
from jaxserve.quant.weight_format import WeightFormat, WeightPlan
from jaxserve.sharding import Parallel, ShardingRules, make_mesh, state_formats, state_shardings

ROWS = 64


def _par() -> Parallel:
    devices = topologies.get_topology_desc(topology_name="v6e:2x4", platform="tpu").devices
    return Parallel(make_mesh(devices), ShardingRules.tensor_parallel())


def _weight_moves(module, par: Parallel, pinned: bool, call, *inputs) -> list[dict]:  # noqa: ANN001
    """Copies / transposes of a weight's shape in the compiled `call(module, *inputs)`, its weights placed with
    their formats (pinned) or the default layouts."""
    graphdef, state = nnx.split(module)
    shardings = (state_formats if pinned else state_shardings)(par, state)
    args = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
    rep = NamedSharding(par.mesh, P())
    xs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep) for x in inputs]
    with jax.set_mesh(par.mesh):
        hlo = jax.jit(lambda st, *x: call(nnx.merge(graphdef, st), *x)).lower(args, *xs).compile().as_text()
    return [m for m in moves(hlo, _tracked_shapes(args, NoPool())) if m["of"] == "weight"]


@functools.cache
def _absorbed(pinned: bool) -> list[dict]:
    """GLM-5.2's absorbed decode projections (16 heads over 8 chips) for 64 rows."""
    par = _par()
    cfg = from_hf_config(dict(PRESETS["glm-5.2"], num_attention_heads=16, num_key_value_heads=16,
                              num_hidden_layers=4))
    with jax.set_mesh(par.mesh):
        attn = nnx.eval_shape(lambda: MLAttention(cfg, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), path="layers.3.attn",
                                                  parallel=par))
    q_nope = jax.ShapeDtypeStruct((ROWS, 1, 16, cfg.qk_nope_head_dim), jnp.bfloat16)
    q_rope = jax.ShapeDtypeStruct((ROWS, 1, 16, cfg.qk_rope_head_dim), jnp.bfloat16)

    def call(m: MLAttention, qn: jax.Array, qr: jax.Array) -> jax.Array:  # the latent attention itself aside
        return m.absorb_output(m.absorb_query(qn, qr)[..., :cfg.kv_lora_rank], jnp.bfloat16)

    return _weight_moves(attn, par, pinned, call, q_nope, q_rope)


@functools.cache
def _shared_fp8(pinned: bool) -> list[dict]:
    """An FP8 MoE block (Mosaic FP8 kernels, GLM-5.2's hidden size) whose shared expert splits 64 wide."""
    par = _par()
    cfg = from_hf_config(dict(PRESETS["glm-5.2"], moe_intermediate_size=8 * 64, n_routed_experts=32,
                              num_hidden_layers=4))
    plan = WeightPlan(WeightFormat("fp8", use_kernel=True, backend="tpu"))
    with jax.set_mesh(par.mesh):
        moe = nnx.eval_shape(lambda: MoE(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), path="layers.3.mlp",
                                         weights=plan, parallel=par))
    x = jax.ShapeDtypeStruct((1, 512, cfg.hidden_size), jnp.bfloat16)
    return _weight_moves(moe, par, pinned, lambda m, x: m(x), x)


def test_absorbed_mla_reads_kv_b_as_held():
    """kv_b held with r minor on TPU: no copy of it (the default [r, N*(dn+dv)] row-major shard was copied to r
    minor before the W_UK dot, every layer, every decode and prefill call)."""
    assert not _absorbed(True), _absorbed(True)
    assert [m["shape"] for m in _absorbed(False)] == [[512, 2 * 448]]  # control: the copy the layout removes


@pytest.mark.slow  # two compiles of the FP8 MoE block with its kernels
def test_fp8_shared_expert_shard_narrower_than_a_lane_tile_is_not_copied():
    """The shared expert's FP8 gate / up shards [6144, 64] pinned row-major: the Mosaic kernel reads them where they
    lie. With the default layout XLA:TPU put the 6144-long dim minor (no lane padding) and copied both back to
    row-major in every MoE layer of the prefill."""
    assert not _shared_fp8(True), _shared_fp8(True)
    control = [(m["shape"], m["count"]) for m in _shared_fp8(False) if m["op"] == "copy"]
    assert control == [([6144, 64], 2)], control  # gate and up, relaid out per call
