"""Child process of tests/test_sharded_load.py: load a checkpoint onto an 8-device mesh and report memory.

Prints one line `RESULT {json}`: RSS after imports (baseline), peak RSS (VmHWM), RSS after the load, and
whether every array landed on its rule's sharding.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxserve.checkpoint import load  # noqa: E402
from jaxserve.sharding import Parallel, ShardingRules, make_mesh, param_sharding  # noqa: E402


def status(field: str) -> int:
    """A /proc/self/status memory field in bytes: VmRSS (now) or VmHWM (this process image's peak; unlike
    ru_maxrss it is not inherited from the parent across fork)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def main() -> None:
    path, preset = sys.argv[1], sys.argv[2]
    mesh = make_mesh(jax.devices())
    rules = ShardingRules.preset(preset)
    base = status("VmRSS")
    _, model = load(path, mesh=mesh, rules=rules)
    jax.block_until_ready(nnx.state(model))
    after, peak = status("VmRSS"), status("VmHWM")
    held = sum(s.data.nbytes for v in jax.tree.leaves(nnx.state(model)) for s in v.addressable_shards)
    par = Parallel(mesh, rules)
    wrong = [".".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(model))
             if v.get_value().sharding != param_sharding(par, ".".join(map(str, p)), v)]
    print("RESULT " + json.dumps({"base": base, "peak": peak, "after": after, "held": held, "wrong": wrong}), flush=True)


if __name__ == "__main__":
    main()
