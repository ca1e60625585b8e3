"""Smoke test of bench/weight_formats.py --quick: it runs end to end and writes the documented JSON (not speed)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import hf_tiny
from jaxserve.convert.converter import convert

BENCH = Path(__file__).resolve().parents[2] / "bench" / "weight_formats.py"


@pytest.mark.slow  # 36 s of CI: the bench's quick run, outside the correctness tests
def test_quick_json_schema(tmp_path):
    spec = importlib.util.spec_from_file_location("weight_formats", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["weight_formats"] = bench  # dataclasses look their module up while the file executes
    spec.loader.exec_module(bench)
    hf_tiny.save(hf_tiny.build("deepseek_v3"), tmp_path / "hf")
    ckpt = convert(tmp_path / "hf", tmp_path / "ck", progress=False)
    out = tmp_path / "wf.json"
    assert bench.main(["--quick", "--concurrency", "1", "2", "--checkpoint", str(ckpt), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["cpu_figures"] is (r["backend"] == "cpu")
    b = r["bytes"]
    for f in ("bf16", "fp8", "int4"):
        assert b["model"][f]["total"] > b["model"][f]["experts"] > 0
    assert b["model"]["bf16"]["experts"] > b["model"]["fp8"]["experts"] > b["model"]["int4"]["experts"]
    k = b["kimi_k2.6_routed_experts"]
    # 60 MoE layers x 384 experts x 3 x 7168 x 2048 weights: bf16 2 B each; int4 g32: 0.5 B + a bf16 scale per 32
    n = 60 * 384 * 3 * 7168 * 2048
    assert k["bytes"]["bf16"] == 2 * n and k["bytes"]["int4_g32"] == n // 2 + n // 32 * 2
    assert abs(k["int4_g32_over_fp8"] - 0.5624) < 1e-3
    assert [d["concurrency"] for d in r["speed"]["decode"]] == [1, 2]
    for d in r["speed"]["decode"]:
        assert d["fp8_tokens_per_s"] > 0 and d["int4_tokens_per_s"] > 0 and len(d["fp8_runs"]) == r["spec"]["reps"]
    assert r["speed"]["prefill"]["fp8_tokens_per_s"] > 0 and r["speed"]["prefill"]["int4_tokens_per_s"] > 0
