"""`Engine.warm_up` levels (engine/warmup.py): after "full", a mixed workload (greedy, seeded, top-k, top-p;
penalties, logit_bias, min_tokens, a JSON-schema grammar, a thinking budget's forced token, top logprobs; n > 1;
prefix hits; short and multi-chunk prompts; rows joining and leaving; preemption; a prompt scored with its logprobs,
lm-eval's echo + logprobs) compiles nothing on the engine thread. The embedded checkpoint, for its tokenizer
(grammars need one)."""
from __future__ import annotations

import collections
import threading
from pathlib import Path

import jax

from engine_util import prompts, small_config, tiny_model
from jaxserve.engine import Engine, Request, SamplingParams
from jaxserve.engine.structured import json_schema_output
from jaxserve.engine.fallback import LADDER, CompiledShapes, largest_keys
from jaxserve.engine.warmup import SERVING_MODES, full_plan, plan_keys

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
EMBEDDED = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi"
SCHEMA = json_schema_output({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})


def _mixed() -> list[SamplingParams]:
    kinds = [dict(), dict(temperature=1.0, seed=7), dict(temperature=0.8, top_k=5, seed=3),
             dict(temperature=0.9, top_p=0.7), dict(temperature=1.0)]
    return [SamplingParams(max_tokens=4 + 3 * (i % 4), ignore_eos=True, **kinds[i % len(kinds)]) for i in range(12)]


def _special() -> list[SamplingParams]:
    """Rows whose batches take the general sampling form: each extra a request can ask for."""
    kinds = [dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.3, ignore_eos=True),
             dict(temperature=0.9, seed=4, logit_bias=((7, 5.0), (11, -100.0)), ignore_eos=True),
             dict(min_tokens=5), dict(structured=SCHEMA), dict(thinking_budget=(2, (100,)), ignore_eos=True),
             dict(temperature=1.0, top_k=6, seed=9, logprobs=True, top_logprobs=3, ignore_eos=True)]
    return [SamplingParams(max_tokens=6 + i % 3, **kw) for i, kw in enumerate(kinds)]


def _group(e: Engine, prompt: list[int], n: int) -> list[list]:
    """n > 1 (`submit_group`): n seeded sampled answers with top logprobs to one prompt -> each one's events."""
    params = SamplingParams(max_tokens=5, temperature=1.0, logprobs=True, top_logprobs=2, ignore_eos=True)
    events: list[list] = [[] for _ in range(n)]
    for i, ev in e.submit_group([Request(prompt, params) for _ in range(n)]):
        events[i].append(ev)
    return events


def _workload(e: Engine) -> None:
    """Every row kind after a full warm-up: mixed sampling with preemption, each extra, n > 1, a prefix hit."""
    first = e.generate(prompts(12, seed=5, lengths=(3, 9, 20, 27, 5, 14)) + prompts(6, seed=7), _mixed() + _special())
    group = _group(e, prompts(1, seed=8, lengths=(13,))[0], 3)
    second = e.generate(prompts(3, seed=6, lengths=(25, 2, 11)) + prompts(1, seed=8, lengths=(13,)),
                        _mixed()[:3] + [SamplingParams(max_tokens=3)])
    assert all(o.finish_reason == "length" for o in first[:12] + second[:3])
    assert all(o.finish_reason in ("length", "stop") and o.token_ids for o in first[12:])
    assert first[15].text.lstrip().startswith("{")  # the grammar held
    assert all(evs[-1].finish_reason == "length" and all(len(ev.top_logprobs) == 2 for ev in evs[:-1])
               for evs in group)
    assert second[3].cached_tokens > 0  # the group's prompt, a prefix-cache hit
    # lm-eval's echo + logprobs: the prompt scored in two chunks with its top alternative, nothing generated
    scored = e.generate(prompts(1, seed=9, lengths=(21,)), [SamplingParams(max_tokens=0, prompt_logprobs=1)])[0]
    assert len(scored.prompt_logprobs.logprobs) == 21 and all(len(top) == 1 for top in scored.prompt_logprobs.top[1:])


def test_full_warmup_leaves_nothing_to_compile_on_the_engine_thread():
    # deterministic off: its admission never preempts, and the workload's preemption path must compile nothing too
    cfg = small_config(kv_dtype="fp8", max_batch=4, max_model_len=32, num_decode_pages=20, deterministic=False)
    e = Engine.from_checkpoint(EMBEDDED, cfg)
    try:
        report = e.warm_up("full")
        c = cfg.program_count()
        assert report.jobs["decode"] == c["decode"] * len(SERVING_MODES)
        assert report.jobs["prefill"] == c["prefill"] * len(SERVING_MODES)
        assert report.jobs["handoff"] == c["handoff"]
        assert report.jobs["prefill_scored"] == c["prefill"]  # prompt logprobs: one program per prefill shape
        assert sum(report.jobs.values()) == len(full_plan(e.programs))
        assert report.backend_compiles >= sum(report.jobs.values())  # an unpack or tag-sync job compiles several
        traced = dict(e.programs.compiles)
        threads: list[str] = []

        def listener(event: str, seconds: float, **_: object) -> None:
            if event == BACKEND_COMPILE:
                threads.append(threading.current_thread().name)

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            _workload(e)
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
        assert e.stats()["preemptions"] > 0  # the small decode pool made the workload preempt and recompute
        assert "jaxserve-engine" not in threads, threads
        assert dict(e.programs.compiles) == traced
    finally:
        e.close()


def test_fast_holds_a_ladder_of_decode_covers_so_a_few_rows_pad_into_a_few_more():
    """max_batch 32: besides the largest decode shape (32 rows) and a lone request's (1 row), fast holds 8 rows x the
    widest table in both forms with its unpacking (`fallback.ladder_shapes`), so a step of 4 rows pads into 8 rows,
    not 32; with max_batch 8 (under 4 x 4 rows) it adds nothing. Nothing compiles here: the plan's keys only."""
    e = Engine(tiny_model(), small_config(max_batch=32), start=False)
    c, keys = e.cfg, plan_keys(e.programs)
    first = largest_keys(e.programs, keys)
    widest = c.page_buckets[-1]
    decode_rows = {k[1] for k in first if k[0] == "decode"}
    assert decode_rows == {1, 8, 32}
    assert {("decode", 8, widest, 0, m) for m in SERVING_MODES} | {("unpack", 8, widest, 0, "")} <= set(first)
    shapes = CompiledShapes(e.programs)
    for k in first:
        shapes.add(k)
    assert shapes.cover("decode", 4, c.page_buckets[0]) == (8, widest, 0)
    assert shapes.cover("decode", 16, c.page_buckets[0]) == (32, widest, 0)
    small = Engine(tiny_model(), small_config(), start=False)
    assert {k[1] for k in largest_keys(small.programs, plan_keys(small.programs)) if k[0] == "decode"} == {1, 8}


def test_fast_holds_prefill_covers_within_half_the_slots():
    """A prefill of at most LADDER rows and at most half the slots (rows x chunk) pads into at most half the slots
    under fast, not into the whole slots (`fallback.ladder_shapes`: first contact's 2 rows of chunk 128 ran in
    2 x 256 of 512 slots). Nothing compiles here: the plan's keys only."""
    e = Engine(tiny_model(), small_config(max_batch=32, max_prefill_tokens=128, prefill_chunk=32), start=False)
    c = e.cfg
    shapes = CompiledShapes(e.programs)
    for k in largest_keys(e.programs, plan_keys(e.programs)):
        shapes.add(k)
    half = [(b, t) for b, t in c.prefill_shapes if b <= LADDER and b * t <= c.prefill_slots // 2]
    assert len(half) > 2 and max(b for b, _ in half) == LADDER
    for b, t in half:
        for m in c.prefill_page_buckets:
            rows, _, chunk = shapes.cover("prefill", b, m, t)
            assert rows >= b and chunk >= t and rows * chunk <= c.prefill_slots // 2, (b, m, t, rows, chunk)


def test_fast_and_none_levels():
    e = Engine(tiny_model(), small_config(kv_dtype="fp8"), start=False)
    assert e.warm_up("none").jobs == {} and dict(e.programs.compiles) == {}
    report = e.warm_up("fast", hold=threading.Event())  # its background thread stays held: the rest is test_fallback's
    first = collections.Counter(k[0] for k in largest_keys(e.programs, plan_keys(e.programs)))
    # the largest shape of each kind in both sampling forms, every hand-off size; the rest waits for the background
    assert dict(e.programs.compiles) == {k: first[k] for k in ("prefill", "decode", "handoff")}
    assert report.backend_compiles > 0 and "prefill_scored" not in first  # the scoring prefill: in the background
    # decode: the largest shape and a lone short request's (1 row x 8 pages), each with its unpacking
    assert first["decode"] == 2 * len(SERVING_MODES) and first["unpack"] == 2
    # and ran each model and hand-off program once (engine.priming): jit's call cache fills only on a call
    assert report.primed == {k: first[k] for k in ("prefill", "decode", "handoff")}
    assert all(f._cache_size() > 0 for f in (e.programs._prefill, e.programs._decode, e.programs._export))
