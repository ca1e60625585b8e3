"""bench/serving.py --first-contact --smoke: a fresh server (its own empty compile cache), the plain and the
tools + json_schema + top_logprobs chat sweeps, first and warm, written as JSON of the documented schema. Nothing
here asserts a speed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_bench_smoke import load

# a server's cold start and eight sweeps: 50 s on a quiet host with a warm cache, 282 s at load 14 with its own empty
# cache (measured): `make test-slow`, as the --pd smoke
pytestmark = pytest.mark.slow


def test_first_contact_smoke(tmp_path: Path) -> None:
    out = tmp_path / "serving_first_contact.json"
    argv = ["--first-contact", "--smoke", "--compile-cache", str(tmp_path / "xla"), "--json", str(out)]
    assert load("serving").main(argv) == 0
    r = json.loads(out.read_text())
    spec = r["spec"]
    assert list(r["levels"]) == ["fast"] and r["uptime"] and "--first-contact" in r["command"]
    level = r["levels"]["fast"]
    assert 0 < level["spawn_to_listening_s"] <= level["spawn_to_ready_s"]
    assert level["cache_before"]["files"] == 0 < level["cache_after"]["files"]  # a cold cache, filled
    assert "XLA programs" in level["warmup_log"] and level["health_after"]["status"] == "ok"
    assert [(s["workload"], s["pass"]) for s in level["sweeps"]] == [
        ("plain", "first"), ("plain", "warm"), ("tools+json_schema+top_logprobs", "first"),
        ("tools+json_schema+top_logprobs", "warm")]
    for s in level["sweeps"]:
        assert [row["concurrency"] for row in s["rows"]] == spec["concurrencies"]
        for row in s["rows"]:
            assert row["completed"] == row["requests"] == max(spec["min_requests"], spec["rounds"] * row["concurrency"])
            assert row["errors"] == [] and row["completion_tokens"] > 0
            for k in ("ttft", "itl"):
                assert row[k]["p50_ms"] <= row[k]["p99_ms"]
            assert row["max_gap_ms"] >= row["itl"]["p99_ms"] and row["gaps_over_1s"] >= 0
        if s["workload"] == "plain":  # ignore_eos: every answer is exactly output_tokens long
            assert all(row["completion_tokens"] == row["requests"] * spec["output_tokens"] for row in s["rows"])
    for workload, by_c in level["ratios"].items():
        assert sorted(by_c) == sorted(str(c) for c in spec["concurrencies"]) and all(x > 0 for x in by_c.values())
    assert set(level["goals"]) == {"ttft_p99_first_over_warm_le_1.5", "no_gap_over_1s"}
