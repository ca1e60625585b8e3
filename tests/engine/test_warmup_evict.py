"""`--warmup full` under a memory-mapping budget (engine/warmup.py `run_jobs`): past `max_maps` the compiled
programs are dropped to the persistent compile cache; right after ready a mixed workload loads nothing on the engine
thread (the dropped shapes run padded while the background loads them again), and every covered shape, and the
workload after every program is cleared, loads its programs from that cache: XLA cache hits only, no XLA compile.
Without the cache a grid over the budget is refused. The cached run is its own process: the compile cache is
process-global config."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_util import small_config, tiny_model
from jaxserve.engine import Engine
from jaxserve.errors import ConfigError

_CHILD = """
import json, sys, threading
import jax
sys.path.insert(0, sys.argv[2])
from engine_util import prompts, small_config, tiny_model
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.compile_cache import enable_compile_cache
from jaxserve.engine.warmup import WarmupReport, counting, full_plan, map_count

enable_compile_cache(sys.argv[1])
e = Engine(tiny_model(), small_config(kv_dtype="fp8", max_batch=4, max_model_len=32, num_decode_pages=20,
                                      deterministic=False))  # its workload preempts: the non-deterministic policy
plan = full_plan(e.programs)
hits = {"n": 0, "compiles": 0}

def on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits" and threading.current_thread().name == "jaxserve-engine":
        hits["n"] += 1

def on_duration(event, seconds, **_):
    if event == "/jax/core/compile/backend_compile_duration" and \
            threading.current_thread().name == "jaxserve-engine":
        hits["compiles"] += 1

jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
kinds = [dict(), dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=5, seed=3),
         dict(temperature=0.9, top_p=0.7)]
params = [SamplingParams(max_tokens=4 + 3 * (i % 4), ignore_eos=True, **kinds[i % 4]) for i in range(12)]
work = prompts(12, seed=5, lengths=(3, 9, 20, 27, 5, 14))
# a budget over what the process holds that the fast set fits in and the whole grid passes: evictions
report = e.warm_up("full", max_maps=map_count() + 4500)
# right after ready: the shapes the bound dropped run padded while the background loads them again
first = e.generate(work, params)
after_ready = dict(hits, padded=e.stats()["padded_steps"], finish=[o.finish_reason for o in first])
e.scheduler.shapes.stop(60)  # no background load (nor its priming's small programs) counted with the shapes below
shapes = []
for kind, job in plan:  # each covered shape again, as a request would select it
    again = WarmupReport("again")
    with counting(again):
        job()
    shapes.append([kind, again.backend_compiles, again.cache_hits])
hits.update(n=0, compiles=0)
jax.clear_caches()  # behind the engine's back: its steps then load every program they run (no loaded cover)
outs = e.generate(work, params)
e.close()
print(json.dumps({"jobs": len(plan), "evictions": report.evictions, "warmup_compiled":
                  report.backend_compiles - report.cache_hits, "shapes": shapes,
                  "engine_backend": hits["compiles"], "engine_hits": hits["n"],
                  "finish": [o.finish_reason for o in outs], "after_ready": after_ready,
                  "preemptions": e.stats()["preemptions"]}))
"""


def test_full_warmup_over_the_budget_evicts_and_every_shape_then_loads_without_compiling(tmp_path):
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "xla"), str(root / "tests")], cwd=root,
                          check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["evictions"] >= 1  # the budget was passed, and the warm-up still completed
    assert out["warmup_compiled"] > 0  # a cold cache: the warm-up compiled (and stored) the grid
    assert len(out["shapes"]) == out["jobs"]
    for kind, backend, hits in out["shapes"]:
        assert backend == hits, (kind, backend, hits)  # every XLA program a shape needs came from the cache
    assert out["engine_hits"] > 0  # the engine thread loaded programs from the cache ...
    assert out["engine_backend"] == out["engine_hits"]  # ... and compiled none
    assert out["finish"] == ["length"] * 12 and out["preemptions"] > 0
    ready = out["after_ready"]  # the workload right after ready: nothing loaded or compiled on the engine thread
    assert ready["n"] == 0 and ready["compiles"] == 0, ready
    assert ready["padded"] > 0  # the shapes the bound dropped ran padded in loaded ones meanwhile
    assert ready["finish"] == ["length"] * 12


def test_full_warmup_over_the_budget_without_the_compile_cache_is_refused():
    e = Engine(tiny_model(), small_config(kv_dtype="fp8", max_batch=4, max_model_len=32), start=False)
    with pytest.raises(ConfigError) as err:
        e.warm_up("full", max_maps=0)
    assert err.value.value > 0 and "compile cache" in str(err.value)
    assert dict(e.programs.compiles) == {}  # refused before compiling anything


_AFTER_READY = """
import dataclasses, json, sys, threading
import jax
sys.path.insert(0, sys.argv[2])
from engine_util import prompts, small_config, tiny_model
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.compile_cache import enable_compile_cache
from jaxserve.engine.warmup import WarmupReport, counting, map_count

enable_compile_cache(sys.argv[1])
cfg = small_config(kv_dtype="fp8", max_batch=4, max_model_len=32, num_decode_pages=20,
                   deterministic=False)  # its workload preempts: the non-deterministic policy
kinds = [dict(), dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=5, seed=3),
         dict(temperature=0.9, top_p=0.7, seed=11)]
params = [SamplingParams(max_tokens=4 + 3 * (i % 4), ignore_eos=True, **kinds[i % 4]) for i in range(12)]
work = prompts(12, seed=5, lengths=(3, 9, 20, 27, 5, 14))
# the reference: no bound reached; synchronous engines step the same batches in the same order, so tokens match
ref = Engine(tiny_model(), cfg, start=False)
want = [o.token_ids for o in ref.generate(work, params)]
loaded = map_count()
ref.close()
del ref
jax.clear_caches()
# ready with nothing in memory (as after the full warm-up's last eviction): the steps load back every program the
# workload runs, twice the mappings over what the process holds that the budget allows: it is passed
e = Engine(tiny_model(), dataclasses.replace(cfg, max_maps=(map_count() + loaded) // 2), start=False)
after = WarmupReport("after ready")
with counting(after):  # only this thread compiles or loads anything here: it is the one that steps
    outs = e.generate(work, params)
print(json.dumps({"evictions": e.stats()["evictions"],
                  "backend": after.backend_compiles, "hits": after.cache_hits, "maps": map_count(),
                  "max_maps": e.map_guard.max_maps, "same": [o.token_ids == w for o, w in zip(outs, want)],
                  "finish": [o.finish_reason for o in outs], "preemptions": e.stats()["preemptions"]}))
e.close()
"""


@pytest.mark.slow  # 12-14 min at load ~19 (every eviction reloads the workload's programs): outside CI's budget
def test_after_ready_the_steps_keep_the_mapping_bound_and_reload_from_the_cache(tmp_path):
    """After ready, traffic loads back the programs the warm-up dropped; between steps the engine drops them again
    once past max_maps (engine.warmup.MapGuard): it evicts, every request still gets the tokens of an engine that
    never evicted, and what the stepping thread loads comes from the cache (XLA cache hits, no XLA compile)."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _AFTER_READY, str(tmp_path / "xla"), str(root / "tests")], cwd=root,
                          check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["evictions"] >= 1  # the steps evicted (stats, /metrics jaxserve_program_evictions)
    assert out["same"] == [True] * 12 and out["finish"] == ["length"] * 12
    assert out["hits"] > 0 and out["backend"] == out["hits"]  # reloads after ready: cache hits only
    assert out["preemptions"] > 0
