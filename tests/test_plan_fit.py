"""jaxserve.plan_fit's accounting and jaxserve.plan's pool sizing on small made-up compiles (no compiler): KV tokens
are positive only where the decode program compiled at that pool fits a device's memory less the reserve, a token
costs the pool's bytes as laid out (TPU tile padding), and the compiled figures found in bench/results obey it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxserve.plan import _sized_decode
from jaxserve.plan_compile import PhaseCompile
from jaxserve.plan_fit import kv_fit

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
PS = 64


def _memory(weights: int, others: int, pool: int, temp: int, unaliased: int = 16) -> dict[str, int]:
    """memory_analysis() of a decode step: weights + batch + pool in, the pool aliased out with a few small rows."""
    return {"argument": weights + others + pool, "output": pool + unaliased, "temp": temp, "generated_code": 0,
            "alias": pool}


def _peak(m: dict[str, int]) -> int:
    return m["argument"] + m["temp"] + m["output"] - m["alias"]


@pytest.mark.parametrize("padding", [1.0, 648 / 580])  # GPU: nominal bytes; TPU: 576 + 4 padded to 640 + 8
@pytest.mark.parametrize("weights", [10_000, 60_000, 99_000])
def test_tokens_are_positive_only_where_the_program_at_that_pool_fits(weights, padding):
    nominal, budget = 58, 100_000
    compiled_tokens = 64 * 128  # the rows' pool, far more than fits beside the larger weights
    m = _memory(weights, 300, int(compiled_tokens * nominal * padding), 500)
    f = kv_fit(m, compiled_tokens, nominal, weights, weights, budget)
    assert f.fits == (_peak(m) <= budget) and f.need >= _peak(m)
    assert f.bytes_per_token == pytest.approx(nominal * padding, rel=1e-4)  # what a token costs as laid out
    if f.tokens:  # the same program at the pool of f.tokens tokens fits
        at = _memory(weights, 300, int(f.tokens * nominal * padding), 500)
        again = kv_fit(at, f.tokens, nominal, weights, weights, budget)
        assert again.fits and _peak(at) <= again.need <= budget
    else:
        assert weights + 300 + 500 + nominal * padding > budget


def test_the_stale_v6e_kimi_plan_did_not_fit_and_overstated_tokens():
    """bench/results/plan_v6e_kimi_k26.json as first committed: decode arguments 41.7 GB (21.0 GB of INT4 weights +
    the 64 x 8k rows' pool, 20.7 GB in TPU tiles) on a 32 GB chip beside 134,995 KV tokens, which were counted at the
    nominal 35,380 B a token, not the 39,528 B the TPU pool takes."""
    memory = {"argument": 41737459200, "output": 20726842912, "temp": 213388512, "generated_code": 458456064,
              "alias": 20726841344}
    weights, nominal, budget, rows_pool = 21010456576, 61 * (576 + 4), 32e9 - 6e9, (64 * 128 + 1) * 64
    f = kv_fit(memory, rows_pool, nominal, weights, weights, budget)
    assert not f.fits and f.need > 32e9
    assert f.bytes_per_token > nominal * 1.1  # the tiles' padding
    assert 0 < f.tokens < 134995 and f.tokens * f.bytes_per_token <= f.pool_bytes


def test_an_unaliased_pool_counts_its_copy():
    """A pool not updated in place comes out as a second buffer: it is in the need, a token is nominal bytes."""
    m = {"argument": 1000 + 580, "output": 580 + 16, "temp": 50, "generated_code": 0, "alias": 0}
    f = kv_fit(m, 10, 58, 1000, 1000, 5000)
    assert f.bytes_per_token == 58 and f.need == _peak(m) and f.fits


def test_weights_the_program_does_not_read_still_take_memory():
    """Resident weights beyond the program's arguments (an MTP head, a colocated prefill format) are counted once;
    colocated temporaries are the larger phase's."""
    m = _memory(1000, 10, 580, 50)
    alone, more = kv_fit(m, 10, 58, 1000, 1000, 5000), kv_fit(m, 10, 58, 1800, 1000, 5000, temp=400)
    assert alone.pool_bytes - more.pool_bytes == 800 + 350


def _compiler(weights: int, per_token: float, temp_per_token: float):  # noqa: ANN202
    """A made-up compiler: a decode at `pages` pages, its temporaries growing with the pool by temp_per_token."""
    def compile_at(pages: int) -> PhaseCompile:
        tokens = pages * PS
        return PhaseCompile(0.0, _memory(weights, 100, int(tokens * per_token), 1000 + int(tokens * temp_per_token)),
                            pool_pages=pages)
    return compile_at


@pytest.mark.parametrize("temp_per_token", [0.0, 3.0])
@pytest.mark.parametrize("weights", [1_000_000, 4_000_000, 4_990_000])
def test_the_decode_is_recompiled_at_the_pool_that_fits(weights, temp_per_token):
    budget, nominal = 5e6, 58
    compile_at = _compiler(weights, nominal * 1.1, temp_per_token)
    fit_of = lambda r: kv_fit(r.memory, r.pool_pages * PS, nominal, weights, weights, budget)  # noqa: E731
    first = compile_at(64 * 128 + 1)
    r, f = _sized_decode(compile_at, first, fit_of, PS, 1)
    if f.fits:
        assert r.pool_pages >= 2 and _peak(r.memory) <= budget
        assert (r.pool_pages + 1) * PS * nominal * 1.1 > 0.99 * f.pool_bytes  # within a page and 1% of all that fits
    else:
        assert r is first and f.tokens < 2 * PS  # nothing fits: no pool compiled, the plan reports 0 tokens


@pytest.mark.parametrize("path", sorted(RESULTS.glob("plan_*.json")), ids=lambda p: p.stem)
def test_committed_plans_report_tokens_only_beside_a_decode_that_fits(path):
    """Every committed plan: where it reports KV tokens, its compiled decode's arguments + temporaries + unaliased
    outputs are within one device's memory less the reserve."""
    p = json.loads(path.read_text())
    budget = p["spec"]["memory_bytes"] - p["spec"]["reserve_bytes"]
    for mode, r in p["modes"].items():
        m = r["phases"]["decode"].get("memory")
        if m and r["kv_tokens"] > 0:
            assert _peak(m) <= budget, (mode, _peak(m) / 1e9, r["kv_tokens"])
