"""First executions before ready (engine/priming.py): `warm_up("fast")` runs every program it compiled once, through
the serving entry points (their jit call caches are filled), counts them in its report, and running them on padding
leaves every page, scale and device tag of both pools as it was (a prefix hit still hits, with the same tokens)."""
from __future__ import annotations

import collections
import threading

import jax
import numpy as np
import pytest

from engine_util import prompts, small_config, tiny_model
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.fallback import largest_keys
from jaxserve.engine.priming import run_all, runnable
from jaxserve.engine.warmup import plan_keys

CFG = small_config(kv_dtype="fp8", max_batch=2, max_model_len=32, prefill_chunk=16, max_prefill_tokens=16)


def _pools(e: Engine) -> list[np.ndarray]:
    """Host copies of every array of both pools (pages, scales, tags)."""
    return [np.asarray(x) for ph in e.programs.phases() for x in jax.tree.leaves(ph.pages)]


@pytest.mark.slow  # ~35 s CPU (4 min at load 11): its own fast warm-up; test_warmup checks the counts cheaply
def test_fast_warm_up_runs_its_programs_once_and_leaves_the_pools_untouched():
    e = Engine(tiny_model(), CFG, start=False)
    try:
        report = e.warm_up("fast", hold=threading.Event())  # the background thread stays held
        fast = largest_keys(e.programs, plan_keys(e.programs))
        want = collections.Counter(k[0] for k in fast if runnable(e.programs, k))
        assert report.primed == dict(want) and set(want) == {"prefill", "decode", "handoff"}
        progs = e.programs
        # executed through the serving path: jit's call cache holds an entry only after a call, not after compile
        assert all(f._cache_size() > 0 for f in (progs._prefill, progs._decode, progs._export, progs._import))

        prompt = prompts(1, seed=3, lengths=(13,))
        first = e.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))[0]
        before = _pools(e)
        with e._step_lock:
            assert run_all(progs, fast, e.scheduler.ranks) == dict(want)
        after = _pools(e)
        assert len(before) == len(after) and all(np.array_equal(a, b) for a, b in zip(before, after))
        again = e.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))[0]
        assert again.cached_tokens > 0 and again.token_ids == first.token_ids
    finally:
        e.close()
