"""What the block-scale rule of jaxserve.sharding costs per device: for each real model, weight format and device
count, the bytes of block scales kept whole on a dim whose weight shard lies inside one block, and of weight/scale
pairs kept whole on a dim where a shard would start mid-block, beyond an even split (per device).

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD .venv/bin/python bench/block_scale_bytes.py > bench/results/block_scale_bytes.json
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64").strip()

import json  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.config import from_hf_config  # noqa: E402
from jaxserve.plan import PRESETS, PlanSpec, _abstract  # noqa: E402
from jaxserve.sharding import Parallel, ShardingRules, make_mesh, param_axes, param_spec  # noqa: E402


def extra_bytes(model: nnx.Module, par: Parallel) -> dict[str, int]:
    """Per-device bytes beyond an even split by the declared axes, of scales ("scales") and weights ("weights")."""
    out = {"scales": 0, "weights": 0}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        blocks = var.get_metadata().get("blocks")
        if blocks is None:
            continue
        name = ".".join(map(str, path))
        x = var.get_value()
        held = math.prod(jax.sharding.NamedSharding(par.mesh, param_spec(par, name, var)).shard_shape(x.shape))
        even = math.prod(x.shape) // math.prod(par.size(a) for a in param_axes(name, var))
        out["scales" if blocks.scale else "weights"] += (held - even) * x.dtype.itemsize
    return out


def main() -> None:
    rows = []
    for preset in ("kimi-k2.6", "glm-5.2"):
        cfg = from_hf_config(PRESETS[preset])
        for fmt in ("int4", "fp8"):
            model = _abstract(cfg, fmt, PlanSpec(target="cpu"))
            for devices in (16, 32, 64):
                for sharding in ("tp", "ep"):
                    par = Parallel(make_mesh(jax.devices()[:devices]), ShardingRules.preset(sharding))
                    rows.append({"model": preset, "weights": fmt, "devices": devices, "sharding": sharding,
                                 "extra_bytes_per_device": extra_bytes(model, par)})
    print(json.dumps({"command": "JAX_PLATFORMS=cpu PYTHONPATH=$PWD .venv/bin/python bench/block_scale_bytes.py",
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
