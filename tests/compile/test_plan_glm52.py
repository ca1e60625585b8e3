"""GLM-5.2's real programs (DSA sparse attention past index_topk: 64 rows x 8k decode, one 512-token prefill chunk
over 8k) compiled for TPU v5p (8 chips, XLA:TPU + Mosaic) and 8 x H200 (XLA:GPU + Triton) on abstract weights at 4
layers (3 dense layers with full indexers + 1 MoE layer sharing its selection). Asserted on what the compiler
reported: the decode writes the latent rows and indexer keys in place (no copy of any pool array), and sparse
prefill's gathered latent rows are blockwise over queries (the temporaries stay under one [T, K, 576] f32 block)."""
from __future__ import annotations

import functools
import math

import pytest

from jaxserve.config import from_hf_config
from jaxserve.hlo_bytes import _types
from jaxserve.models import dsa
from jaxserve.models.build import shard_model
from jaxserve.plan import PRESETS, PlanSpec, _abstract
from jaxserve.plan_compile import PhaseCompile, compile_phase
from jaxserve.sharding import Parallel, ShardingRules, make_mesh
from jaxserve.targets import TARGETS, target_devices

LAYERS = 4


@functools.cache
def _compiled(target: str, phase: str, devices: int = 8, layers: int = LAYERS) -> tuple[PlanSpec, PhaseCompile]:
    t = TARGETS[target]
    spec = PlanSpec(devices=devices, target=target, memory_bytes=t.memory_bytes)
    par = Parallel(make_mesh(target_devices(t, devices), dp=1), ShardingRules.preset("tp"))
    cfg = from_hf_config(dict(PRESETS["glm-5.2"], num_hidden_layers=layers))
    assert cfg.index_layers[:3] == (0, 1, 2) and dsa.is_sparse(spec.decode_context, cfg.index_topk)
    fmt = spec.decode_weights if phase == "decode" else spec.prefill_weights
    model = shard_model(_abstract(cfg, fmt, spec), par)
    return spec, compile_phase(cfg, model, par, spec, phase, t.attention, in_mesh=True)


def test_glm52_v5p_decode_copies_no_pool():
    """The DSA decode writes its new latent row and indexer key with one dynamic_update_slice each (as Kimi's MLA
    decode): a scatter copied the 8-bit latent pool and the index-key scales in and out on every call."""
    _, r = _compiled("v5p", "decode")
    assert r.memory["temp"] > 0
    moves = [m for m in r.moves if m["of"].startswith("pool")]
    assert not moves, moves
    assert {c["kind"] for c in r.collectives} == {"all-reduce"}  # activations only: DSA runs per shard


def test_glm52_h200_prefill_sparse_rows_blockwise():
    """One [1, 512, 2048, 576] f32 array of gathered rows (2.4 GB) no longer sits in the prefill temporaries: the
    sparse attention runs over query blocks of `dsa.QUERY_BLOCK` inside the per-shard map."""
    spec, r = _compiled("h200", "prefill")
    cfg = from_hf_config(PRESETS["glm-5.2"])
    one_shot_rows = spec.prefill_chunk * cfg.index_topk * cfg.latent_dim * 4
    assert 0 < r.memory["temp"] < one_shot_rows, r.memory
    assert {c["kind"] for c in r.collectives} == {"all-reduce"}
    assert not [m for m in r.moves if m["op"] == "all-gather"]



@pytest.mark.slow  # two real-size compiles for 32 v6e chips (~1 and ~3 min)
@pytest.mark.parametrize("phase,layers", [("decode", 4), ("prefill", 5)])
def test_glm52_v6e_32_chips_moves_no_weight(phase, layers):
    """GLM-5.2 over 32 v6e chips (2 heads and a 64-wide shared expert FFN a chip), the prefill at 5 layers so that
    one MoE layer runs all 512 rows (the last layer's MLP runs the sampled row only): no weight is copied or
    transposed (kv_b and the FP8 shared expert's gate / up are held in the layouts the dots and the Mosaic kernel
    read, `sharding.param_format`; XLA:TPU relaid them out in every layer), and no weight or pool is gathered."""
    _, r = _compiled("v6e", phase, devices=32, layers=layers)
    assert r.memory["temp"] > 0
    assert not [m for m in r.moves if m["of"] == "weight" or m["op"] == "all-gather"], r.moves


def widened_sparse_rows(traffic: list[dict], rows: int, topk: int, latent_dim: int) -> list[dict]:
    """The traffic rows (plan_compile.PhaseCompile.traffic) outside the kernels that write the decode's gathered
    top-k latent rows ([rows, topk, latent_dim] elements, any shape) wider than the pool's 8 bits."""
    n = rows * topk * latent_dim
    return [t for t in traffic if t["category"] == "outside"
            and any(math.prod(s) == n and dt not in ("u8", "s8", "f8e4m3fn") for dt, s in _types(t["result"]))]


@pytest.mark.slow  # reuses test_glm52_v6e_32_chips_moves_no_weight[decode-4]'s compile (~1-3 min alone)
def test_glm52_v6e_decode_sparse_rows_stay_8_bit():
    """GLM-5.2's sparse decode on v6e (attention="pallas_tpu") writes no widened copy of the 2048 selected latent
    rows of each of the 64 rows: the Mosaic sparse_mla_decode_tpu reads them from the pool itself (before it, the
    XLA path gathered them, and dequantized first XLA:TPU wrote them in f32 and relaid the f32 array out for the
    dots: f32[64, 2048, 576], 377 + 604 MB a layer)."""
    spec, r = _compiled("v6e", "decode", devices=32, layers=4)
    cfg = from_hf_config(PRESETS["glm-5.2"])
    rows = widened_sparse_rows(r.traffic, spec.decode_rows, cfg.index_topk, cfg.latent_dim)
    assert not rows, rows
