"""`--warmup fast` with an eviction after ready (engine/fallback.py, engine/resident.py): a program the mapping bound
drops (`warmup.MapGuard`, least recently used first) takes its shape out of `CompiledShapes.usable`; its steps pad
into a shape still loaded, the background thread loads it again from the persistent compile cache once a padded
step wants it, and the engine thread loads nothing. Its own process: the compile cache is process-global config."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = """
import gc, json, sys, threading, time
import jax
sys.path.insert(0, sys.argv[2])
from engine_util import backend_compiles, prompts, small_config, tiny_model
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.compile_cache import enable_compile_cache
from jaxserve.engine.fallback import MODEL_KINDS, _shape_of
from jaxserve.engine.warmup import map_count

enable_compile_cache(sys.argv[1])
cfg = small_config(kv_dtype="fp8", max_batch=4, max_model_len=64, prefill_chunk=32, max_prefill_tokens=32)
kinds = [dict(), dict(temperature=1.0, seed=7), dict(presence_penalty=0.5, repetition_penalty=1.3),
         dict(temperature=0.8, top_k=5, seed=3), dict(frequency_penalty=0.4)]
params = [SamplingParams(max_tokens=3 + 4 * (i % 3), ignore_eos=True, **kinds[i % len(kinds)]) for i in range(7)]

def workload(e):
    outs = e.generate(prompts(1, seed=1, lengths=(5,)), SamplingParams(max_tokens=4))
    outs += e.generate(prompts(7, seed=2, lengths=(3, 40, 9, 17, 33, 2, 12)), params)
    return [o.token_ids for o in outs]

def on_engine_thread(run):
    out = []
    t = threading.Thread(target=lambda: out.extend(run()), name="jaxserve-engine")
    t.start()
    t.join()
    return out

ref = Engine(tiny_model(), cfg, start=False)  # no warm-up, no bound reached: every step in its own bucket
want = workload(ref)
ref.close()
del ref
jax.clear_caches()
gc.collect()
e = Engine(tiny_model(), cfg, start=False)
hold = threading.Event()
e.warm_up("fast", hold=hold)
shapes = e.scheduler.shapes
with backend_compiles() as names:
    runs = [on_engine_thread(lambda: workload(e))]  # padded: the background is held
    hold.set()
    shapes.finished.wait()  # demand order: the workload's shapes were loaded first, so they are the least recent
    on_engine_thread(lambda: e.generate(prompts(1, seed=9, lengths=(5,)), SamplingParams(max_tokens=6)))  # a lone
    e.map_guard.max_maps = map_count() - 1  # a small max_maps: the next check after a load evicts
    jax.jit(lambda x: x + 1)(1)  # a load (this thread's): the engine's next check sees one
    runs.append(on_engine_thread(lambda: workload(e)))  # evicted shapes pad, and load again in the background
    evicted = [k for k in shapes.evicted if k[0] in MODEL_KINDS]
    wanted = {k for k in evicted if shapes.demand(k) > 0}  # wanted by a padded step since: to load again
    t0 = time.monotonic()
    while not wanted <= shapes.done and time.monotonic() - t0 < 300:
        time.sleep(0.1)
    back = {_shape_of(k) for k in wanted}
    usable_again = sorted(back & shapes.usable)
    runs.append(on_engine_thread(lambda: workload(e)))
e.close()
print(json.dumps({"same": [r == want for r in runs], "engine": names.count("jaxserve-engine"),
                  "background": sum(n == "jaxserve-compile-background" for n in names),
                  "evictions": e.map_guard.evictions, "evicted": len(evicted), "wanted": len(wanted),
                  "back": sorted(back), "usable_again": usable_again, "reloads": shapes.reloads}))
"""


@pytest.mark.slow  # a cold reference, the fast warm-up and its background grid: 6.2 min at load 7-8
def test_an_evicted_shape_pads_then_loads_again_in_the_background(tmp_path):
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "xla"), str(root / "tests")], cwd=root,
                          check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["evictions"] >= 1 and out["evicted"] > 0  # past max_maps after ready: programs were dropped
    assert out["engine"] == 0  # ... and the engine thread loaded none back: its steps padded meanwhile
    assert out["same"] == [True] * 3  # the tokens of an engine that never evicted, before, during and after
    assert out["wanted"] > 0 and out["reloads"] >= out["wanted"], out  # the background loaded the wanted ones again
    assert out["background"] > 0 and out["usable_again"] == out["back"]  # and their shapes are usable again
