"""bench/kernels.py runs (--smoke: toy shapes, interpret mode) and writes its schema; bench/gpu.sh and bench/tpu.sh
run every kernel micro-benchmark and the engine benches within the 10-minute device budget. No speed asserted."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import pytest

from test_bench_smoke import BENCH, load

KERNELS = {"paged_mla_decode", "paged_gqa_decode", "paged_prefill_mla", "paged_prefill_gqa", "int4_matmul",
           "moe_gmm"}


def _smoke(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "kernels.json"
    assert load("kernels").main(["--smoke", *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _check(r: dict, backend: str) -> None:
    assert r["backend"] == backend and r["interpret"] and r["smoke"]
    assert {row["kernel"] for row in r["rows"]} == KERNELS
    for row in r["rows"]:
        assert row["status"] == "ok", row
        assert row["bytes"] > 0 and row["flops"] > 0 and row["median_s"] > 0 and row["gb_per_s"] > 0


def test_kernels_smoke_gpu_tilings(tmp_path: Path) -> None:
    _check(_smoke(tmp_path, "--backend", "gpu"), "gpu")


@pytest.mark.slow
def test_kernels_smoke_tpu_tilings(tmp_path: Path) -> None:
    _check(_smoke(tmp_path, "--backend", "tpu"), "tpu")


@pytest.mark.parametrize("script", ["gpu.sh", "tpu.sh"])
def test_device_scripts_run_every_bench_within_ten_minutes(script: str) -> None:
    """Each `run NAME LIMIT ...` line names a bench that exists; kernels runs with the script's tilings; the
    per-bench limits (hard timeouts) sum to under 10 minutes; every engine bench with a --quick mode is run."""
    text = (BENCH / script).read_text()
    runs = re.findall(r"^run (\w+) (\d+)(.*)$", text, flags=re.M)
    names = [n for n, _, _ in runs]
    assert all((BENCH / f"{n}.py").exists() for n in names), names
    assert sum(int(s) for _, s, _ in runs) < 600
    assert ("kernels", f" --backend {script[:3]}") in [(n, a) for n, _, a in runs]
    quick = {p.stem for p in BENCH.glob("*.py")  # the entry points (serving_pd is serving.py --pd's module)
             if "--quick" in p.read_text() and "__main__" in p.read_text() and p.stem != "report"}
    assert quick <= set(names), quick - set(names)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_every_real_shape_case_lowers_for_its_platform(backend: str) -> None:
    """The cases the device scripts will run, at the real shapes, lower for cuda (Triton) / tpu (Mosaic, v6e
    declared) from their abstract inputs: the first device run does not fail on a wiring or shape error."""
    from tests.kernel_lowering import TPU_V6E, lower_for

    bench = load("kernels")
    cases = bench.attention_cases(bench.REAL, backend, False, ("bf16", "fp8")) + bench.matmul_cases(
        bench.REAL, backend, False)
    assert {c.name for c in cases} == KERNELS and len(cases) == 12
    platform, kind = ("cuda", None) if backend == "gpu" else ("tpu", TPU_V6E)
    for c in cases:
        specs = jax.eval_shape(c.make)
        assert lower_for(c.fn, *specs, platform=platform, device_kind=kind), c.name
        assert c.bytes > 0 and c.flops > 0
