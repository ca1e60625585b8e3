"""The Mosaic grouped matmul (`moe_gmm`, backend "tpu", INT4 g32) compiled alone for one chip of a TPU target at a
model's per-chip routed-expert shapes: which of the call's operands XLA:TPU placed in VMEM (`S(1)`) and the
`copy-start` / `slice-start` prefetches feeding it. Shows whether memory-space assignment moves the expert weights
or scales into VMEM whole, which the kernel should read from HBM itself (moe_gmm_tpu pins them to HBM).

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=$PWD .venv-aot/bin/python bench/gmm_prefetch.py \
        v6e 12 7168 2048 512      # target, experts a chip, K, N, routed rows (Kimi K2.6 gate on 32 v6e, c = 64)
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve import hlo_bytes
from jaxserve.targets import TARGETS, target_devices
from pallas_kernels.moe_gmm import moe_gmm

TOKENS, GROUP = 64, 32
OPERANDS = ("x_even", "x_odd", "w", "scale")  # the call's last four operands (before them: the visit layout)


def main(target: str, experts: int, k: int, n: int, rows: int) -> dict:
    t = TARGETS[target]
    mesh = Mesh(np.array(target_devices(t, 8)[:1]), ("d",))
    at = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    args = (at((TOKENS, k), jnp.bfloat16), at((experts, k // 2, n), jnp.uint8),
            at((experts, k // GROUP, n), jnp.bfloat16), at((experts,), jnp.int32), at((rows,), jnp.int32))
    fn = lambda x, w, s, gs, r: moe_gmm(x, w, s, gs, fmt="int4", backend="tpu", rows=r)  # noqa: E731
    with jax.set_mesh(mesh):
        text = jax.jit(fn).lower(*args).compile().as_text()
    comps, entry = hlo_bytes.parse(text)
    by_name = {i.name: i for i in comps[entry]}
    call = next(i for i in comps[entry] if i.op == "custom-call" and "moe_gmm" in i.attrs)
    srcs = [by_name[o] for o in call.operands[-len(OPERANDS):]]
    return {"target": target, "experts": experts, "k": k, "n": n, "rows": rows,
            "in_vmem": {name: not s.in_hbm(0) for name, s in zip(OPERANDS, srcs)},
            "prefetches": [f"{i.op} {i.types[1] if len(i.types) > 1 else i.types}" for i in comps[entry]
                           if i.op in ("copy-start", "slice-start")]}


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(a[0], *(int(v) for v in a[1:5])), indent=1))
