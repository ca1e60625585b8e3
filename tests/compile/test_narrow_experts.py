"""Routed experts whose FFN splits into shards that are not whole TPU lane tiles (128) under tensor parallelism: on a TPU mesh the
sharding rules split whole experts over expert_ffn's mesh axes instead (jaxserve.sharding._narrow_experts), and the
compiled MoE block (XLA:TPU, the Mosaic INT4 grouped-matmul kernel, v6e:2x4) relays out no expert weight. The
real-size cases: Kimi K2.6 / GLM-5.2 over 32 v6e chips (2048 / 32 = 64), GLM-4.5 over 8 chips (1536 / 8 = 192). A
256-wide shard keeps the FFN split."""
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
from jaxserve.models.layers import MoE
from jaxserve.plan import PRESETS
from jaxserve.plan_compile import _tracked_shapes, moves
from jaxserve.quant.weight_format import WeightFormat, WeightPlan
from jaxserve.sharding import Parallel, ShardingRules, make_mesh, state_shardings

EXPERTS, HIDDEN, TOKENS = 32, 1024, 64


@functools.cache
def _compiled(ffn: int) -> tuple[dict, list[dict]]:
    """The MoE block (INT4 g32 experts, `ffn` wide, 8-way TP on v6e:2x4) compiled: (expert weight path -> spec,
    copies / transposes of a weight shape in the HLO)."""
    devices = topologies.get_topology_desc(topology_name="v6e:2x4", platform="tpu").devices
    par = Parallel(make_mesh(devices), ShardingRules.tensor_parallel())
    cfg = from_hf_config(dict(PRESETS["kimi-k2.6"], hidden_size=HIDDEN, moe_intermediate_size=ffn,
                              n_routed_experts=EXPERTS, num_hidden_layers=2))
    plan = WeightPlan(WeightFormat("int4", 32, use_kernel=True, backend="tpu"))
    with jax.set_mesh(par.mesh):
        moe = nnx.eval_shape(lambda: MoE(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), path="layers.1.mlp",
                                         weights=plan, parallel=par))
        graphdef, state = nnx.split(moe)
        shardings = state_shardings(par, state)
        args = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
        x = jax.ShapeDtypeStruct((1, TOKENS, HIDDEN), jnp.bfloat16, sharding=NamedSharding(par.mesh, P()))
        hlo = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)).lower(args, x).compile().as_text()
    specs = {".".join(map(str, path)): s.spec for path, s in jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda s: isinstance(s, NamedSharding))[0] if "experts" in str(path)}
    assert "tpu_custom_call" in hlo  # the Mosaic kernel ran, not the XLA path
    return specs, moves(hlo, _tracked_shapes(args, NoPool()))


@pytest.mark.parametrize("ffn", [pytest.param(8 * 64, id="64-wide"),
                                 pytest.param(8 * 192, id="192-wide"),  # GLM-4.5's shard at 8 chips
                                 pytest.param(8 * 256, id="256-wide", marks=pytest.mark.slow)])  # control: CI time
def test_tp_experts_split_whole_where_the_ffn_shard_is_narrower_than_a_lane_tile(ffn):
    specs, moved = _compiled(ffn)
    assert len(specs) == 6  # gate, up, down and their scales
    narrow = (ffn // 8) % 128 != 0  # not whole lane tiles
    for path, spec in specs.items():
        split = [i for i, a in enumerate(spec) if a == "tp"]
        assert split == ([0] if narrow else [1 if "down" in path else 2]), (path, spec)  # experts | the FFN dim
    # whole experts per chip: the kernel reads them where they lie (the rows before: 2 copies of u8[32, 512, 64];
    # 192 wide: of u8[32, 512, 192] and the down scale bf16[32, 6, 1024])
    assert not narrow or not [m for m in moved if m["op"] == "copy" and len(m["shape"]) == 3], moved
