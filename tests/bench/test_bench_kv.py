"""Smoke tests of the KV benches (kv_capacity, integrity_overhead): they run and write their JSON schema.
Speeds are not asserted; the capacity ratio is arithmetic and is."""
from __future__ import annotations

import json

from test_bench_smoke import load, positive


def test_kv_capacity(tmp_path):
    out = tmp_path / "kv.json"
    assert load("kv_capacity").main(["--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["model"] == "kimi-k2.6" and r["ratio"] >= 1.97
    assert r["fp8_tokens_per_gib"] > r["bf16_tokens_per_gib"] > 0
    assert {m["model"] for m in r["models"]} >= {"kimi-k2.6", "glm-4.5"}


def test_integrity_overhead(tmp_path):
    out = tmp_path / "io.json"
    assert load("integrity_overhead").main(["--smoke", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert {"median_ratio", "cost_pct", "goal_cost_pct", "rows", "backend"} <= set(r)
    [row] = r["rows"]
    assert row["batch"] == 1 and positive(row["tokens_per_s_on"]) and positive(row["tokens_per_s_off"])
    assert positive(row["check_alone_s"]) and positive(row["decode_step_s"])
