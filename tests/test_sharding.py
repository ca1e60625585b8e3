"""The block-scale rule of jaxserve.sharding: a quantized weight's scales split with it where each shard holds whole
blocks, stay whole (each device slicing its block) where a shard lies inside one block, and the pair stays whole on
a dim where a shard would start inside a block. The sharded FP8 linears give the unsharded result in every case."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import hf_tiny
from jaxserve.config import from_hf_config
from jaxserve.models import CausalLM
from jaxserve.models.build import shard_model
from jaxserve.models.layers import Experts, Linear
from jaxserve.models.transformer import forward
from jaxserve.quant.weight_format import MatmulFormat, WeightFormat, WeightPlan
from jaxserve.sharding import Parallel, ShardingRules, make_mesh, param_spec, state_shardings

TP = 8
FP8 = MatmulFormat("fp8")


def _par() -> Parallel:
    return Parallel(make_mesh(jax.devices()[:TP]), ShardingRules.tensor_parallel())


# split dim size -> (weight spec entry, scale spec entry) over 8 shards of 128-wide blocks
CASES = {8 * 256: ("tp", "tp"),    # 256 per shard: whole blocks
         8 * 64: ("tp", None),     # 64 per shard: inside one block, scale whole
         8 * 192: (None, None)}    # 192 per shard: shard 1 starts mid-block, the pair whole


@pytest.mark.parametrize("n", sorted(CASES))
def test_linear_pair_specs_follow_the_block_grid(n):
    par = _par()
    w_entry, s_entry = CASES[n]
    col = nnx.eval_shape(lambda: Linear(256, n, axes=("embed", "ffn"), dtype=jnp.float32, rngs=nnx.Rngs(0),
                                        fmt=FP8, parallel=par))
    assert param_spec(par, "weight", col.weight) == P(None, w_entry)
    assert param_spec(par, "scale", col.scale) == P(None, s_entry)
    experts = nnx.eval_shape(lambda: Experts(8, 256, n, dtype=jnp.float32, rngs=nnx.Rngs(0), fmt=FP8,
                                             parallel=par))
    assert param_spec(par, "down", experts.down) == P(None, w_entry, None)
    assert param_spec(par, "down_scale", experts.down_scale) == P(None, s_entry, None)


@pytest.mark.parametrize("n", sorted(CASES))
@pytest.mark.parametrize("axes", [("embed", "ffn"), ("ffn", "embed")], ids=["column", "row"])
def test_sharded_fp8_linear_equals_unsharded(n, axes):
    par = _par()
    din, dout = (256, n) if axes[1] == "ffn" else (n, 256)

    def build(p: Parallel | None) -> Linear:
        return Linear(din, dout, axes=axes, dtype=jnp.float32, rngs=nnx.Rngs(1), fmt=FP8, parallel=p)

    whole, sharded = build(None), build(par)
    graphdef, state = nnx.split(sharded)
    sharded = nnx.merge(graphdef, jax.device_put(state, state_shardings(par, state)))
    x = jax.random.normal(jax.random.key(2), (4, din), jnp.float32)
    want = whole(x)
    got = jax.jit(lambda m, x: m(x))(sharded, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~12 s CPU each (two model builds, two forwards)
@pytest.mark.parametrize("rules", ["tp", "ep"])
def test_fp8_model_on_4_devices_equals_one_device(rules):
    """A tiny Kimi-architecture model in FP8 (expert FFN 32 -> 8 per device under TP, shared expert likewise:
    scales kept whole; dense MLP 384 -> 96 per device: the pair kept whole, as Kimi K2.6's over 32 devices) gives
    one device's logits."""
    cfg = from_hf_config(dict(hf_tiny.kimi_config().to_dict(), intermediate_size=384))
    model = CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), weights=WeightPlan(WeightFormat("fp8")))
    par = Parallel(make_mesh(jax.devices()[:4]), ShardingRules.preset(rules))
    placed = shard_model(model, par)
    tokens = jax.random.randint(jax.random.key(3), (2, 6), 0, cfg.vocab_size, jnp.int32)
    want = np.asarray(forward(model, tokens))
    np.testing.assert_allclose(np.asarray(forward(placed, tokens)), want, atol=1e-5 * np.abs(want).max())
