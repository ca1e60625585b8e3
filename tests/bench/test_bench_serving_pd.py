"""Smoke test of `bench/serving.py --pd P:D` (bench/serving_pd.py) at its smallest size: 1 prefill + 1 decode server
behind a router and one --role both server start, every pass completes with zero errors, and the JSON carries the
documented fields. Nothing here asserts a speed."""
from __future__ import annotations

import json

import pytest

from test_bench_smoke import load, positive

# four server processes and a router for a minute: `make test-slow` (CI's budget goes to the PD checks in tests/server)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("results") / "serving_pd.json"
    assert load("serving").main(["--pd", "1:1", "--smoke", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_pass_completes_without_errors(result: dict) -> None:
    spec = result["spec"]
    kinds = [f"c{c}" for c in spec["concurrencies"]] + [f"c{spec['concurrencies'][0]}+long"]
    assert set(result["layouts"]) == {"pd 1:1", "both x2"}
    assert len(result["passes"]) == spec["reps"] * len(kinds) * 2
    for p in result["passes"]:
        s = p["summary"]
        assert s["errors"] == 0 and s["completed"] == s["planned"] > 0, s["error_samples"]
        assert len(p["loadavg_before"]) == len(p["loadavg_after"]) == 3
        if p["kind"].endswith("+long"):  # the long prompts ran beside the short streams, and all answered
            assert p["long"]["errors"] == 0 and p["long"]["completed"] >= 1
            assert p["long"]["prompt_tokens"] == spec["long_prompt_len"] * p["long"]["completed"]
        else:
            assert "long" not in p


def test_summary_fields(result: dict) -> None:
    spec = result["spec"]
    for lay in result["layouts"]:
        kinds = result["summary"][lay]
        assert list(kinds) == [f"c{c}" for c in spec["concurrencies"]] + [f"c{spec['concurrencies'][0]}+long"]
        for d in kinds.values():
            assert d["errors"] == 0 and d["completed"] > 0
            for k in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
                assert d[k]["min"] <= d[k]["median"] <= d[k]["max"] and d[k]["n"] == spec["reps"]
            assert positive(d["output_tokens_per_s"]["min"])
        i = result["interference"][lay]
        assert positive(i["ratio"]) and i["goal_met"] == (i["ratio"] <= i["goal"])
        assert i["ratio"] == pytest.approx(i["itl_p99_with_long_ms"] / i["itl_p99_without_ms"])
    assert len(result["loadavg_start"]) == len(result["loadavg_end"]) == 3 and positive(result["start_s"])
