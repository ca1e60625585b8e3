"""Kimi K2.6's FP8 prefill chunk (2 layers, TP, 512 tokens) compiled for a TPU target as `jaxserve plan` compiles it,
over a prefill pool of `context` tokens (129 pages at 8k; 2049 at 128k): the compiler's memory_analysis and every
copy / transpose / pool-writing fusion of a weight or pool shape (plan_compile's search). Where the Mosaic MLA
prefill was handed one layer of the pool, v6e copied that layer's whole slice per chunk (temporaries ~ one layer).

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=$PWD .venv-aot/bin/python bench/prefill_pool_copy.py \
        v6e 8 131072
"""
from __future__ import annotations

import json
import sys

from jaxserve.config import from_hf_config
from jaxserve.models.build import shard_model
from jaxserve.plan import PRESETS, PlanSpec, _abstract
from jaxserve.plan_compile import compile_phase
from jaxserve.sharding import Parallel, ShardingRules, make_mesh
from jaxserve.targets import TARGETS, target_devices


def main(target: str, devices: int, context: int) -> dict:
    t = TARGETS[target]
    spec = PlanSpec(target=target, memory_bytes=t.memory_bytes, prefill_context=context)
    par = Parallel(make_mesh(target_devices(t, devices), dp=1), ShardingRules.preset("tp"))
    cfg = from_hf_config(dict(PRESETS["kimi-k2.6"], num_hidden_layers=2))
    r = compile_phase(cfg, shard_model(_abstract(cfg, "fp8", spec), par), par, spec, "prefill", t.attention,
                      in_mesh=True)
    return {"target": target, "devices": devices, "prefill_context": context, "layers": 2,
            "compile_s": round(r.seconds, 1), "memory": r.memory, "moves": r.moves}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])), indent=1))
