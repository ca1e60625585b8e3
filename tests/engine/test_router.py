"""Session affinity: the same session id always reaches the same worker, so its prefix cache serves the session."""
from __future__ import annotations

from engine_util import engine, prompts, tiny_model
from jaxserve.engine import Request, SamplingParams
from jaxserve.engine.router import SessionRouter


def test_sessions_stick_to_a_worker_and_hit_its_prefix_cache():
    m = tiny_model("deepseek_v3")
    router = SessionRouter([engine(m), engine(m)])
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    history = prompts(1, seed=11, lengths=(32,))[0]
    chosen = {router.worker_for(f"ses-{i}") for i in range(2)}
    assert chosen == {0, 1}  # new sessions spread over idle workers (least loaded, then sticky)
    ends = []
    for turn in range(3):
        history = history + [turn + 1] * 4
        for s in ("ses-0", "ses-1"):
            events = list(router.submit(Request(list(history), sp, session_id=s)))
            ends.append((s, events[-1]))
    assert router.worker_for("ses-0") != router.worker_for("ses-1")
    for s, end in ends[2:]:  # every later turn reuses the session's earlier pages on the same worker
        assert end.cached_tokens >= 32, s
    none_cached = list(router.submit(Request(prompts(1, seed=12, lengths=(20,))[0], sp)))[-1]
    assert none_cached.cached_tokens == 0
    assert router.stats()["running"] == 0
