"""`--warmup fast`'s padded fallback (engine/fallback.py): with only the largest shapes compiled (the background
thread held before its first job), a mixed workload compiles nothing on the engine thread and gives the tokens of
an engine with no warm-up (a lone short request runs its own shapes, compiled before ready too); released, the
background thread compiles the rest of the grid and steps use their own buckets again."""
from __future__ import annotations

import gc
import os
import sys
import threading

import jax

from engine_util import prompts, small_config, tiny_model
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.fallback import BACKGROUND_NICE, BACKGROUND_SWITCH_S, MODEL_KINDS, CompiledShapes, largest_keys
from jaxserve.engine.warmup import plan_keys

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
# rows 1, 2, 4; decode pages 8, 12, 16; prefill pages 8, 16; chunks 16, 32 (rows x chunk <= 32)
CFG = small_config(kv_dtype="fp8", max_batch=4, max_model_len=64, prefill_chunk=32, max_prefill_tokens=32)


def _params() -> list[SamplingParams]:
    kinds = [dict(), dict(temperature=1.0, seed=7), dict(presence_penalty=0.5, repetition_penalty=1.3),
             dict(temperature=0.8, top_k=5, seed=3, logprobs=True, top_logprobs=3), dict(frequency_penalty=0.4)]
    return [SamplingParams(max_tokens=3 + 4 * (i % 3), ignore_eos=True, **kinds[i % len(kinds)]) for i in range(7)]


def _workload(e: Engine) -> list[tuple[list[int], int]]:
    """One row, then 7 mixed rows (short and multi-chunk prompts), then two: -> (token ids, finish reason) each."""
    outs = e.generate(prompts(1, seed=1, lengths=(5,)), SamplingParams(max_tokens=4))
    outs += e.generate(prompts(7, seed=2, lengths=(3, 40, 9, 17, 33, 2, 12)), _params())
    outs += e.generate(prompts(2, seed=3, lengths=(20, 6)), _params()[1:3])
    return [(o.token_ids, o.finish_reason) for o in outs]


def _on_engine_thread(e: Engine) -> tuple[list, list[str]]:
    """Run `_workload` on a thread named as the engine's loop -> (its outputs, the threads of every XLA compile)."""
    threads: list[str] = []
    out: list = []

    def listener(event: str, seconds: float, **_: object) -> None:
        if event == BACKEND_COMPILE:
            threads.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        t = threading.Thread(target=lambda: out.extend(_workload(e)), name="jaxserve-engine")
        t.start()
        t.join()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return out, threads


def test_fast_serves_padded_until_the_background_compiles_its_shape():
    e = Engine(tiny_model(), CFG, start=False)
    hold = threading.Event()
    try:
        report = e.warm_up("fast", hold=hold)
        # the warm-up's long-lived objects are out of the collector's full walks (engine.heap)
        assert report.freeze_seconds is not None and gc.get_freeze_count() > 0
        shapes = e.scheduler.shapes
        keys = plan_keys(e.programs)
        assert report.jobs and sum(report.jobs.values()) == len(largest_keys(e.programs, keys)) < len(keys)
        first = set(shapes.usable)
        assert {s[0] for s in first} == {"prefill", "decode"} and ("decode", 4, 16, 0) in first
        assert ("decode", 2, 8, 0) not in first and shapes.cover("decode", 2, 8) == (4, 16, 0)
        # a lone short request runs its own decode shape, and one prefill covering every chunk of such a prompt
        assert shapes.cover("decode", 1, 8) == (1, 8, 0) and shapes.cover("prefill", 1, 8, 16) == (1, 8, 32)
        assert not any(s[0] == "prefill_scored" for s in first)  # the scoring prefill waits for the background

        pending = len(keys) - sum(report.jobs.values())
        # the two cover() calls above padded (decode 2 x 8 into 4 x 16, the 16-token chunk into 32)
        assert e.stats()["programs_pending"] == pending and e.stats()["padded_steps"] == shapes.padded == 2
        got, threads = _on_engine_thread(e)
        assert "jaxserve-engine" not in threads, threads  # every step ran padded in a compiled shape
        assert shapes.usable == first  # nothing compiled meanwhile: the background thread is held
        wanted = dict(shapes.wanted)  # the padded steps' shapes, counted
        assert wanted and not set(wanted) & first
        # every wanted step ran padded (none compiled its own): the operator's counter (stats, /metrics) says so
        assert e.stats()["padded_steps"] == sum(wanted.values())

        ref = Engine(tiny_model(), CFG, start=False)  # no warm-up: every step in its own bucket
        try:
            want = _workload(ref)
        finally:
            ref.close()
        assert got == want

        hold.set()
        shapes.finished.wait()  # the plan compiled (the thread stays to reload evicted shapes)
        # each background job froze what it added: a full collection walks far fewer objects than it skips
        assert len(gc.get_objects()) < gc.get_freeze_count()
        grid = {k[:4] for k in keys if k[0] in MODEL_KINDS}
        assert shapes.usable == grid and shapes.done == set(keys)
        assert e.stats()["programs_pending"] == 0 and e.stats()["program_reloads"] == 0
        padded = e.stats()["padded_steps"]
        # demand order: the background's first job is of the shape the most padded steps wanted, and every wanted
        # shape's keys come before any shape no step wanted
        background = shapes.order[len(shapes.order) - (len(keys) - sum(report.jobs.values())):]
        demand = [shapes.demand(k) for k in background]
        assert demand[0] == max(wanted.values()) and demand == sorted(demand, reverse=True)
        assert shapes.cover("decode", 1, 8) == (1, 8, 0)
        rows: list[int] = []
        dispatch = e.programs.dispatch_decode
        e.programs.dispatch_decode = lambda batch, samp: (rows.append(batch.tokens.shape[0]), dispatch(batch, samp))[1]
        again, threads = _on_engine_thread(e)
        assert "jaxserve-engine" not in threads, threads  # its own shapes, compiled in the background
        assert again == got and 1 in rows and min(rows) < 4
        assert e.stats()["padded_steps"] == padded  # every step in its own shape now
    finally:
        e.close()
    assert gc.get_freeze_count() == 0  # closed: its objects are the collector's again


def test_close_ends_the_background_compiles():
    """Engine.close() stops the fast warm-up's background thread: the jobs it has not started are skipped (none here:
    it is held before its first), and no thread is left compiling after the engine. The thread ran at the lowest
    priority (on Linux: its nice value, read on its own thread id in its `done` call; its starter's is unchanged) with
    the short GIL switch interval, restored after."""
    e = Engine(tiny_model(), CFG, start=False)
    shapes = CompiledShapes(e.programs)
    e.scheduler.shapes = shapes
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[float] = []
    switch = sys.getswitchinterval()

    def done(_: object) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        seen.append(sys.getswitchinterval())

    thread = shapes.start(plan_keys(e.programs), hold=threading.Event(), done=done)
    assert thread.is_alive()
    e.close()
    assert not thread.is_alive() and shapes.done == set()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine and sys.getswitchinterval() == switch
    assert seen[1] == min(switch, BACKGROUND_SWITCH_S)
    if sys.platform.startswith("linux"):
        assert seen[0] == BACKGROUND_NICE and mine < BACKGROUND_NICE


EXIT_CHILD = """
import atexit, sys, threading
sys.path[:0] = {paths!r}
from engine_util import small_config, tiny_model
from jaxserve.engine import Engine
from jaxserve.engine.fallback import CompiledShapes
from jaxserve.engine.warmup import plan_keys
seen = {{}}
# registered before the engine's hook, so it runs after it (atexit: last registered first)
atexit.register(lambda: print("at exit: loop", seen["loop"].is_alive(), "background", seen["bg"].is_alive(),
                              flush=True))
e = Engine(tiny_model(), small_config(kv_dtype="fp8", max_batch=4, max_model_len=64, prefill_chunk=32,
                                      max_prefill_tokens=32), start=True)
shapes = CompiledShapes(e.programs)
e.scheduler.shapes = shapes
seen["loop"], seen["bg"] = e._thread, shapes.start(plan_keys(e.programs), hold=threading.Event())
print("exiting without close", flush=True)
"""


def test_an_engine_never_closed_is_closed_at_exit_before_jax_tears_down():
    """A library user who exits without Engine.close() while its threads run: the engine's exit hook
    (engine.exit_hook) closes it before JAX's own exit handlers, so no daemon thread is left inside XLA at
    finalization (that aborted the process, exit 134, in about 1 run of 3: bench/exit_abort.py)."""
    import subprocess

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = EXIT_CHILD.format(paths=[tests, os.path.dirname(tests)])
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exiting without close" in proc.stdout
    assert "at exit: loop False background False" in proc.stdout, proc.stdout


