"""`Engine.warm_up` levels (engine/warmup.py): after "full", a mixed workload (greedy, seeded, top-k, top-p; short
and multi-chunk prompts; rows joining and leaving; preemption) compiles nothing on the engine thread."""
from __future__ import annotations

import threading

import jax

from engine_util import prompts, small_config, tiny_model
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.warmup import SERVING_MODES, full_plan

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _mixed() -> list[SamplingParams]:
    kinds = [dict(), dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=5, seed=3),
             dict(temperature=0.9, top_p=0.7), dict(temperature=1.0)]
    return [SamplingParams(max_tokens=4 + 3 * (i % 4), ignore_eos=True, **kinds[i % len(kinds)]) for i in range(12)]


def test_full_warmup_leaves_nothing_to_compile_on_the_engine_thread():
    cfg = small_config(kv_dtype="fp8", max_batch=4, max_model_len=32, num_decode_pages=20)
    e = Engine(tiny_model(), cfg)
    try:
        report = e.warm_up("full")
        c = cfg.program_count()
        assert report.jobs["decode"] == c["decode"] * len(SERVING_MODES)
        assert report.jobs["prefill"] == c["prefill"] * len(SERVING_MODES)
        assert report.jobs["handoff"] == c["handoff"]
        assert sum(report.jobs.values()) == len(full_plan(e.programs))
        assert report.backend_compiles >= sum(report.jobs.values())  # an unpack or tag-sync job compiles several
        traced = dict(e.programs.compiles)
        threads: list[str] = []

        def listener(event: str, seconds: float, **_: object) -> None:
            if event == BACKEND_COMPILE:
                threads.append(threading.current_thread().name)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            first = e.generate(prompts(12, seed=5, lengths=(3, 9, 20, 27, 5, 14)), _mixed())
            second = e.generate(prompts(3, seed=6, lengths=(25, 2, 11)), _mixed()[:3])
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert all(o.finish_reason == "length" for o in first + second)
        assert e.stats()["preemptions"] > 0  # the small decode pool made the workload preempt and recompute
        assert "jaxserve-engine" not in threads, threads
        assert dict(e.programs.compiles) == traced
    finally:
        e.close()


def test_fast_and_none_levels():
    e = Engine(tiny_model(), small_config(kv_dtype="fp8"), start=False)
    assert e.warm_up("none").jobs == {} and dict(e.programs.compiles) == {}
    report = e.warm_up("fast")
    assert dict(e.programs.compiles) == {"prefill": 1, "decode": 1, "handoff": 1}
    assert report.backend_compiles > 0 and e.deferred_compiles  # the sampled programs wait for an idle engine
