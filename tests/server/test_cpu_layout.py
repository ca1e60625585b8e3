"""`serve --cpu-layout`: what each choice resolves to by core count and platform (a pure function), and a served
greedy request under the layout `auto` picks for two cores (and under dp) returns the same tokens as the one-device
server."""
from __future__ import annotations

import httpx2 as httpx
import pytest
from serve_procs import start_serve

from jaxserve.errors import ConfigError
from jaxserve.server.cpu_layout import AUTO, CPU_LAYOUTS, SCHED_FLAG, CpuLayout, resolve

TIMEOUT = 300.0  # a cold embedded-model start on a loaded 2-core host


def test_auto_is_one_device_on_one_core_and_the_measured_winner_on_two():
    assert resolve("auto", 1, "cpu") == CpuLayout("single")
    # README "Every core": one device with the concurrency-optimized scheduler won on 2 cores (cpu_cores_quiet*.json)
    assert AUTO == "sched"
    assert resolve("auto", 2, "cpu") == resolve(AUTO, 2, "cpu") == CpuLayout("sched", xla_flags=SCHED_FLAG)
    assert resolve("single", 2, "cpu") == CpuLayout("single")  # no flag


def test_explicit_layouts_use_one_device_or_replica_per_core():
    assert resolve("tp", 2, "cpu") == CpuLayout("tp", cpu_devices=2, devices=2)
    assert resolve("dp", 4, "cpu") == CpuLayout("dp", cpu_devices=4, devices=4, sharding="dp_attention")
    assert resolve("workers", 2, "cpu") == CpuLayout("workers", cpu_devices=2, workers=2)
    for choice in CPU_LAYOUTS:  # one core has one layout
        assert resolve(choice, 1, "cpu") == CpuLayout("single")


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_no_cpu_layout_on_an_accelerator(platform):
    for choice in CPU_LAYOUTS:
        assert resolve(choice, 2, platform) is None
        assert resolve(choice, 2, platform, devices=8) is None


def test_explicit_devices_or_workers_are_taken_as_given_under_auto_only():
    assert resolve("auto", 2, "cpu", devices=2) == CpuLayout("manual", cpu_devices=2, devices=2)
    assert resolve("auto", 2, "cpu", devices=2, workers=3) == CpuLayout("manual", cpu_devices=6, devices=2, workers=3)
    with pytest.raises(ConfigError) as e:
        resolve("dp", 2, "cpu", workers=2)
    assert e.value.param == "cpu_layout" and e.value.value == "dp"


def test_bad_choice_or_core_count_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        resolve("every", 2, "cpu")
    assert e.value.value == "every"
    with pytest.raises(ConfigError) as e:
        resolve("auto", 0, "cpu")
    assert e.value.param == "cores"


def _greedy(base: str) -> list[list[int]]:
    """Three greedy completions of token-id prompts in one request -> each choice's tokens (logprobs' token texts)."""
    prompts = [[5 + i, 70 + 3 * i, 200 + i, 11] * 4 for i in range(3)]
    body = {"model": "tiny-kimi", "prompt": prompts, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return [c["logprobs"]["tokens"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_a_served_request_under_the_two_core_auto_layout_and_dp_serve_the_same_tokens(tmp_path):
    """auto (what two cores resolve to: one device, the concurrency-optimized scheduler) and dp (one device per core,
    DP attention: the layout that creates devices) serve the same greedy tokens."""
    outs, logs = {}, {}
    for layout in ("auto", "dp"):
        served = start_serve(tmp_path / "xla", "--cpu-layout", layout, "--cpu-cores", "2")
        try:
            outs[layout] = _greedy(served.base)
            logs[layout] = "".join(served.log)
        finally:
            served.proc.terminate()
            served.proc.wait(timeout=60)
    assert "CPU layout sched: 1 engine(s) x 1 device(s)" in logs["auto"]
    assert "CPU layout dp: 1 engine(s) x 2 device(s)" in logs["dp"]
    assert all(len(t) == 12 for t in outs["auto"])
    assert outs["dp"] == outs["auto"]
