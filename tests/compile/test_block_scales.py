"""FP8 linears whose dims the block-scale rule of jaxserve.sharding treats specially, compiled (not lowered) for TPU
v6e over its 8-chip topology with the Mosaic FP8 matmul kernel in: a shard inside one 128-block (scale kept whole,
each device slicing its block) and a shard that would start mid-block (the pair kept whole, still run per device:
a Mosaic kernel has no SPMD partitioning). The real-size case is Kimi K2.6 / GLM-5.2 over 32 v6e chips."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.models.layers import Linear
from jaxserve.quant.weight_format import MatmulFormat
from jaxserve.sharding import Parallel, ShardingRules, make_mesh, state_shardings

FP8_TPU = MatmulFormat("fp8", use_kernel=True, backend="tpu")


@pytest.mark.parametrize("n", [8 * 64, 8 * 192], ids=["scale-whole", "pair-whole"])
@pytest.mark.parametrize("axes", [("embed", "ffn"), ("ffn", "embed")], ids=["column", "row"])
def test_fp8_linear_compiles_for_v6e(n, axes):
    devices = topologies.get_topology_desc(topology_name="v6e:2x4", platform="tpu").devices
    par = Parallel(make_mesh(devices), ShardingRules.tensor_parallel())
    din, dout = (256, n) if axes[1] == "ffn" else (n, 256)
    with jax.set_mesh(par.mesh):
        model = nnx.eval_shape(lambda: Linear(din, dout, axes=axes, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), fmt=FP8_TPU,
                                              parallel=par))
        graphdef, state = nnx.split(model)
        args = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                            state_shardings(par, state))
        x = jax.ShapeDtypeStruct((64, din), jnp.bfloat16, sharding=NamedSharding(par.mesh, P()))
        text = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)).lower(args, x).compile().as_text()
    k_local = din // 8 if axes[0] == "ffn" and n == 8 * 64 else din  # row-split only where the weight stays split
    # the Mosaic kernel per device where its K holds whole blocks; else the XLA dequant path (ops.linear)
    assert ("tpu_custom_call" in text) == (k_local % 128 == 0)
