"""The warm-start manifest of `--warmup full` (engine/warm_manifest.py): a full warm-up on a cold cache writes it; a
second process with the same plan then loads only the fast set before ready and the rest from the cache in the
background (XLA cache hits, no XLA compile), its workload getting the first process's greedy tokens. Its name changes with a source file, the engine
config or the plan; a manifest whose cache entries are gone is not trusted. The cached runs are their own processes:
the compile cache is process-global config."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from engine_util import small_config, tiny_model
from jaxserve.engine import Engine
from jaxserve.engine import warm_manifest
from jaxserve.engine.fallback import largest_keys
from jaxserve.engine.warmup import plan_keys

ROOT = Path(__file__).resolve().parents[2]
_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[2])
from engine_util import prompts, small_config, tiny_model
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.compile_cache import enable_compile_cache
from jaxserve.engine.warmup import WarmupReport, counting

enable_compile_cache(sys.argv[1])
e = Engine(tiny_model(), small_config(max_batch=2, max_model_len=16), start=False)
report = e.warm_up("full")
after = WarmupReport("after ready")
with counting(after):  # start=False: this thread steps, so what the workload loads is counted here
    outs = e.generate(prompts(3, seed=2, lengths=(3, 7, 11)), SamplingParams(max_tokens=5, ignore_eos=True))
    # prompt logprobs (lm-eval's echo + logprobs): the scoring prefill is never in the fast set
    scored = e.generate(prompts(1, seed=9, lengths=(9,)), SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    shapes = e.scheduler.shapes  # warm: the background thread loads the rest of the plan from the cache
    background = shapes is not None and shapes.finished.wait(600)
    pending = shapes.pending() if shapes is not None else None
e.close()
print(json.dumps({"background": background, "pending": pending, "skipped": report.skipped, "jobs": sum(report.jobs.values()), "compiled": report.backend_compiles
                  - report.cache_hits, "after": [after.backend_compiles, after.cache_hits],
                  "tokens": [o.token_ids for o in outs], "scores": scored.prompt_logprobs.logprobs}))
"""


def _run(folder: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(ROOT / "tests")], cwd=ROOT, check=True,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_warm_full_warm_up_loads_the_fast_set_and_the_rest_from_the_cache_in_the_background(tmp_path):
    folder = tmp_path / "xla"
    cold = _run(folder)
    manifests = list((folder / warm_manifest.FOLDER).glob("*.json"))
    assert cold["skipped"] == 0 and cold["compiled"] > 0 and len(manifests) == 1
    assert cold["background"] and cold["pending"] == 0  # cold: the whole plan before ready, none left to load
    assert len(json.loads(manifests[0].read_text())["entries"]) >= cold["jobs"]  # a cache key per program at least
    warm = _run(folder)
    assert warm["skipped"] > 0 and warm["jobs"] + warm["skipped"] == cold["jobs"]
    assert warm["compiled"] == 0  # the fast set: cache hits
    assert warm["background"] and warm["pending"] == 0  # the background loaded the rest of the plan
    backend, hits = warm["after"]
    assert hits > 0 and backend == hits  # the rest came from the cache (background and workload): nothing compiled
    assert warm["tokens"] == cold["tokens"] and warm["scores"] == cold["scores"]


def test_the_manifest_name_follows_sources_config_and_plan(tmp_path):
    roots = [tmp_path / name for name in warm_manifest.SOURCES]
    for src, dst in zip(warm_manifest.source_roots(), roots):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    a = Engine(tiny_model(), small_config(max_batch=2, max_model_len=16), start=False)
    b = Engine(tiny_model(seed=1), small_config(max_batch=2, max_model_len=16), start=False)
    c = Engine(tiny_model(), small_config(max_batch=2, max_model_len=32), start=False)
    try:
        keys = plan_keys(a.programs)
        name = warm_manifest.digest(a.programs, keys, roots)
        assert warm_manifest.digest(b.programs, plan_keys(b.programs), roots) == name  # weights' values: arguments
        assert warm_manifest.digest(c.programs, plan_keys(c.programs), roots) != name
        assert warm_manifest.digest(a.programs, largest_keys(a.programs, keys), roots) != name
        kernel = sorted(roots[1].glob("*.py"))[-1]
        kernel.write_text(kernel.read_text() + "\n# changed\n")
        assert warm_manifest.digest(a.programs, keys, roots) != name
    finally:
        for e in (a, b, c):
            e.close()


def test_a_manifest_is_trusted_only_while_its_cache_entries_are_there(tmp_path):
    entries = {"aa11", "bb22"}
    assert not warm_manifest.write(tmp_path, "plan", set(), 3)  # no lookups seen: nothing to vouch for
    assert not warm_manifest.write(tmp_path, "plan", entries, 3)  # not stored
    for key in entries:
        (tmp_path / f"{key}-cache").write_bytes(b"x")
    assert warm_manifest.write(tmp_path, "plan", entries, 3)
    assert warm_manifest.complete(tmp_path, "plan") and not warm_manifest.complete(tmp_path, "other")
    (tmp_path / "bb22-cache").unlink()
    assert not warm_manifest.complete(tmp_path, "plan")
    (tmp_path / warm_manifest.FOLDER / "plan.json").write_text("{not json")
    assert not warm_manifest.complete(tmp_path, "plan")
