"""jaxserve.roofline: the minimum bytes of a decode step, the collective time model, and the predicted bounds,
on small hand-made shapes."""
from __future__ import annotations

import math

import pytest

from jaxserve.roofline import Chip, StepShape, collective_seconds, minimum_bytes, predict, roofline_row, \
    touched_experts

SHAPE = StepShape(dense_weight_bytes=1000, routed_weight_bytes=64_000, experts=64, top_k=4, hidden=16, layers=2,
                  kv_layer_bytes=10)
CHIP = Chip("toy", hbm_bytes_per_s=1e6, link_bytes_per_s=1e5)


def test_touched_experts_between_top_k_and_all():
    assert touched_experts(64, 4, 1) == pytest.approx(4)  # one token: exactly its top-k
    prev = 0.0
    for b in (1, 2, 8, 64, 1024):
        t = touched_experts(64, 4, b)
        assert prev < t <= 64
        prev = t
    assert touched_experts(64, 4, 10_000) == pytest.approx(64)


def test_minimum_bytes_parts():
    m = minimum_bytes(SHAPE, rows=8, context=100)
    frac = touched_experts(64, 4, 8) / 64
    assert m["routed_weights"] == pytest.approx(64_000 * frac)
    assert m["dense_weights"] == 1000 + 8 * 16 * 2  # + the batch's embedding rows (bf16)
    assert m["kv_read"] == 8 * 2 * 100 * 10
    parts = [v for k, v in m.items() if k not in ("total", "touched_experts_per_layer")]
    assert m["total"] == pytest.approx(sum(parts))


def test_sparse_attention_reads_topk_latents_and_every_index_key():
    dsa = StepShape(**{**SHAPE.__dict__, "sparse_topk": 30, "index_layers": 1, "index_token_bytes": 3})
    m = minimum_bytes(dsa, rows=2, context=100)
    assert m["kv_read"] == 2 * 2 * 30 * 10 + 2 * 1 * 100 * 3
    assert minimum_bytes(dsa, rows=2, context=20)["kv_read"] == 2 * 2 * 20 * 10 + 2 * 20 * 3  # context < top-k


def test_dp_attention_reads_its_share_of_rows():
    dp = StepShape(**{**SHAPE.__dict__, "kv_rows_per_device": 1 / 8})
    assert minimum_bytes(dp, 8, 100)["kv_read"] == pytest.approx(minimum_bytes(SHAPE, 8, 100)["kv_read"] / 8)


def test_collective_seconds_ring():
    assert collective_seconds("all-reduce", 800, 8, 100.0) == pytest.approx(2 * 7 / 8 * 800 / 100)
    assert collective_seconds("all-gather", 800, 8, 100.0) == pytest.approx(7 / 8 * 800 / 100)
    assert collective_seconds("all-reduce", 800, 1, 100.0) == 0.0


def test_predict_orders_the_bounds():
    m = minimum_bytes(SHAPE, 8, 100)
    coll = [{"kind": "all-reduce", "count": 3, "bytes": 256}]
    p = predict(m, outside_bytes=5000, matmul_bytes=500, collectives=coll, chip=CHIP, devices=8, rows=8)
    link = 3 * collective_seconds("all-reduce", 256, 8, CHIP.link_bytes_per_s)
    assert p["collective_s"] == pytest.approx(link)
    assert p["hbm_s"] == pytest.approx((m["total"] + 5500) / CHIP.hbm_bytes_per_s)
    assert p["serial_s"] == pytest.approx(p["hbm_s"] + link)
    assert p["ideal_s"] <= p["overlapped_s"] <= p["serial_s"]
    assert p["serial_tokens_per_s"] == pytest.approx(8 / p["serial_s"])


def test_roofline_row_ratio_and_offenders():
    traffic = [{"category": "outside", "op": "fusion:kLoop", "what": "jit(f)/slice", "result": "u8[1,9]",
                "count": 4, "bytes": 100},
               {"category": "outside", "op": "copy", "what": "", "result": "f32[2]", "count": 1, "bytes": 8},
               {"category": "weights", "op": "fusion:kCustom", "what": "dot", "result": "f32[2]", "count": 2,
                "bytes": 500},
               {"category": "kernel", "op": "custom-call", "what": "k", "result": "f32[2]", "count": 1,
                "bytes": 10**9}]
    r = roofline_row(SHAPE, 8, 100, traffic, [], CHIP, 8)
    m = minimum_bytes(SHAPE, 8, 100)
    assert r["traffic_bytes"]["outside"] == 408
    assert r["outside_over_minimum"] == pytest.approx(408 / m["total"])
    assert r["weights_read_over_dense"] == pytest.approx(1000 / 1000)
    assert [o["bytes"] for o in r["offenders"]] == [400, 8]  # kernels and weight reads are never offenders
    assert math.isfinite(r["predicted"]["serial_tokens_per_s"])
