"""`jaxserve plan --target`: Kimi K2.6's real decode program (INT4 g32 experts, FP8 latent pool, 64 rows x 8k context)
compiled for 8 x H200 (XLA:GPU, Pallas Triton kernels) and TPU v5p with 8 chips (XLA:TPU, Mosaic kernels) on
abstract weights, at 2 and 3 layers, scaled to 61 as the plan does. Asserted on what the compiler reported: it fits,
the temporaries are the target's, the only collectives are activation all-reduces, no weight or pool is gathered,
and (H200) it fits with no pool-sized copy; on TPU the latent pool is copied per call (a known finding, xfail
below), which also makes it not fit 95 GB."""
from __future__ import annotations

import functools

import pytest

from jaxserve.config import from_hf_config
from jaxserve.models.build import shard_model
from jaxserve.plan import PRESETS, PlanSpec, _abstract, _per_device_bytes
from jaxserve.plan_compile import compile_phase, scaled
from jaxserve.sharding import Parallel, ShardingRules, make_mesh
from jaxserve.targets import TARGETS, target_devices

LAYERS = 61
ROWS, HIDDEN = 64, 7168


@functools.cache
def _decode(target: str) -> dict:
    t = TARGETS[target]
    spec = PlanSpec(target=target, memory_bytes=t.memory_bytes)
    par = Parallel(make_mesh(target_devices(t, 8), dp=1), ShardingRules.preset("tp"))
    runs = []
    for n in (2, 3):
        cfg = from_hf_config(dict(PRESETS["kimi-k2.6"], num_hidden_layers=n))
        model = shard_model(_abstract(cfg, "int4", spec), par)
        runs.append((compile_phase(cfg, model, par, spec, "decode", t.attention, in_mesh=True),
                     _per_device_bytes(model, par)))
    (a, wa), (b, wb) = runs
    return {"spec": spec, "plan": scaled(a, 2, b, 3, LAYERS), "weights": wb + (LAYERS - 3) * (wb - wa), "at3": b}


@pytest.mark.parametrize("target", ["h200", "v5p"])
def test_kimi_decode_fits_and_moves_only_activations(target):
    d = _decode(target)
    p = d["plan"]
    assert p.memory["temp"] > 0 and d["at3"].memory["temp"] > 0  # the target compiler's temporaries
    assert p.memory["argument"] >= d["weights"] > 70e9  # ~76.5 GB of INT4 weights per device + the pool
    assert {c["kind"] for c in p.collectives} == {"all-reduce"}
    # each MoE / attention output is reduced over the 8 devices: 64 rows x 7168, bf16 or f32, once per layer or so
    big = [c for c in p.collectives if c["bytes"] > 4096]
    assert big and all(c["bytes"] <= ROWS * HIDDEN * 4 and c["shape"][-1] == HIDDEN for c in big), big
    assert LAYERS <= sum(c["count"] for c in big) <= 3 * LAYERS
    assert not [m for m in p.moves if m["op"] == "all-gather"]  # no weight or pool gathered
    assert not [m for m in p.moves if m["of"] == "weight" and m["bytes"] > 16e6]  # no expert stack relaid out


def _fits(d: dict) -> bool:
    """The weights, the 64 x 8k pool and the temporaries within one device's memory less the reserve."""
    return d["plan"].memory["argument"] + d["plan"].memory["temp"] < d["spec"].memory_bytes - d["spec"].reserve_bytes


def test_h200_decode_fits_and_copies_no_pool():
    d = _decode("h200")
    assert _fits(d)
    assert not [m for m in d["plan"].moves if m["of"].startswith("pool")]


@pytest.mark.xfail(strict=True, reason="known finding: XLA:TPU gives the donated uint8 latent pool a layout the "
                   "Mosaic kernel's FP8 view does not take, so the pool (and each layer's slice) is copied per call")
def test_v5p_decode_copies_no_pool():
    """With the copies the temporaries scale with the pool (21 GB at 61 layers): 95 GB does not hold the 76.5 GB
    of weights, the 64 x 8k pool and them."""
    d = _decode("v5p")
    moves = [m for m in d["plan"].moves if m["of"].startswith("pool.latent")]
    assert not moves, moves
    assert _fits(d)
