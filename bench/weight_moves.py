"""One phase of a preset's real program (decode: 64 rows x 8k; prefill: one 512-token chunk over 8k; verify: 3 drafts
+ 1 positions a decode row) compiled at a few
layers for a target's devices under TP, as `jaxserve plan` compiles it: the compiler's memory_analysis and every
copy / transpose / all-gather of a weight or pool shape (plan_compile.moves, with pool-writing fusions), and the
bytes the program moves outside the kernels (hlo_bytes.traffic: the total and the 8 largest rows). A fast
driver for the plan's weight relayouts (GLM-5.2 over 32 v6e chips: ~1 min decode at 4 layers, ~3 min prefill at 5,
on this host) where the whole plan takes ~6 min.

    JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 PYTHONPATH=$PWD .venv-aot/bin/python bench/weight_moves.py \
        glm-5.2 decode 4 v6e 32
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


def main(preset: str, phase: str, layers: int, target: str, devices: int) -> dict:
    t = TARGETS[target]
    spec = PlanSpec(devices=devices, target=target, memory_bytes=t.memory_bytes)
    par = Parallel(make_mesh(target_devices(t, devices), dp=1), ShardingRules.preset("tp"))
    cfg = from_hf_config(dict(PRESETS[preset], num_hidden_layers=layers))
    fmt = spec.prefill_weights if phase == "prefill" else spec.decode_weights  # verify: the decode phase's
    r = compile_phase(cfg, shard_model(_abstract(cfg, fmt, spec), par), par, spec, phase, t.attention,
                      in_mesh=True)
    outside = [t for t in r.traffic if t["category"] == "outside"]
    return {"preset": preset, "phase": phase, "layers": layers, "target": target, "devices": devices,
            "compile_s": round(r.seconds, 1), "memory": r.memory, "moves": r.moves,
            "outside_bytes": sum(t["bytes"] * t["count"] for t in outside), "largest_outside": outside[:8]}


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(a[0], a[1], int(a[2]), a[3], int(a[4])), indent=1))
