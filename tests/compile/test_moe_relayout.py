"""The routed experts' grouped matmul in the real decode programs compiled for TPU v5p with 8 chips (XLA:TPU, the
Mosaic `moe_gmm`): XLA moves no more of the kernel's input than one sorted copy of the routed rows, and relays out
no expert weight. Before: Kimi K2.6's padded one-expert-per-tile input ([T*bm, K], T = rows/16 + 384 tiles) was
built and relaid out in XLA (a transpose, two copies and a reshape of bf16[6656, 7168], 191 MB each per layer at
64 rows); GLM-4.5's 192-wide INT4 expert shards (1536 / 8) were copied every step (gate / up u8[160, 2560, 192],
78.6 MB each per layer)."""
from __future__ import annotations

import functools

import pytest
from test_plan_targets import ROWS, HIDDEN, _decode

from jaxserve.config import from_hf_config
from jaxserve.models.build import shard_model
from jaxserve.plan import PRESETS, PlanSpec, _abstract
from jaxserve.plan_compile import PhaseCompile, compile_phase
from jaxserve.sharding import Parallel, ShardingRules, make_mesh
from jaxserve.targets import TARGETS, target_devices

TOP_K = 8  # Kimi K2.6 / GLM-4.5 route each token to 8 experts
RELAYOUT_OPS = ("copy", "transpose", "reshape")


def _gmm_side(r: PhaseCompile) -> list[dict]:
    """What XLA runs for `moe_gmm` outside the Mosaic kernel (its metadata, the rows' gather)."""
    return [t for t in r.traffic if t["category"] == "outside" and "moe_gmm" in t["what"]]


def test_kimi_v5p_decode_moves_one_sorted_copy_of_the_routed_rows():
    """Kimi K2.6's decode (64 rows, INT4 experts, 3 layers: two MoE layers) reuses test_plan_targets' compile: each
    of XLA's ops for the grouped matmul moves at most one copy of the routed rows (64 x 8 x 7168 bf16, 7.3 MB;
    the int4 kernel's even and odd K columns are gathered as two halves), and none is a relayout."""
    side = _gmm_side(_decode("v5p")["at3"])
    assert [t for t in side if "gather" in t["what"]]  # the sorted rows are gathered here, for the kernel
    rows_bytes = ROWS * TOP_K * HIDDEN * 2
    big = [t for t in side if t["bytes"] > rows_bytes]
    assert not big, big
    assert not [t for t in side if t["op"] in RELAYOUT_OPS and t["bytes"] > rows_bytes // 8], side


@functools.cache
def _glm45_decode() -> PhaseCompile:
    """GLM-4.5's decode (64 rows, INT4 g32 experts) at 4 layers (3 dense + one MoE layer), TP 8 on v5p."""
    t = TARGETS["v5p"]
    spec = PlanSpec(target="v5p", memory_bytes=t.memory_bytes)
    par = Parallel(make_mesh(target_devices(t, 8), dp=1), ShardingRules.preset("tp"))
    cfg = from_hf_config(dict(PRESETS["glm-4.5"], num_hidden_layers=4))
    return compile_phase(cfg, shard_model(_abstract(cfg, spec.decode_weights, spec), par), par, spec, "decode",
                         t.attention, in_mesh=True)


@pytest.mark.slow
def test_glm45_v5p_decode_relays_out_no_expert_weight():
    """Its FFN splits 192 wide under TP 8 (not whole 128-lane tiles): whole experts split over the chips instead
    (`sharding._narrow_experts`), read in place by the kernel. No weight copied (bound: 1 MB, the smallest expert
    operand, down's scale bf16[20, 48, 5120] a chip, is 9.8 MB), the grouped matmul's XLA side as above."""
    r = _glm45_decode()
    assert not [m for m in r.moves if m["of"] == "weight" and m["bytes"] > 1e6], r.moves
    side = _gmm_side(r)
    rows_bytes = ROWS * TOP_K * PRESETS["glm-4.5"]["hidden_size"] * 2
    assert side and not [t for t in side if t["bytes"] > rows_bytes], side
