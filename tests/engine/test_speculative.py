"""Speculative decoding (`EngineConfig(speculative="ngram:K")`): greedy output is token-for-token the same engine's
output without it (f32 and the serving formats, MLA and GQA, the Pallas attention kernels in interpret mode, TP and
DP attention on 8 devices, preemption, a prefix hit, a stop string inside an accepted run, the embedded model); a
stale page under a draft run fails only its request; pages rolled back across page boundaries return to the pool.

Every engine here pins its shapes (one row bucket, one block-table width, one chunk): a different shape is a
different program and may move the last bits of the logits (engine.sampling, "Seeds and batches"), and the
speculative engine runs both the verify and the plain decode program. The prompts repeat themselves so that n-gram
drafts exist, and each test asserts that drafts were accepted, so the speculative path is the one compared.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from engine_util import backend_compiles, engine, pool_is_full, prompts, small_config, stale_page_fails_only_its_request, tiny_model
from jaxserve.engine import Engine, EngineConfig, Request, SamplingParams
from jaxserve.engine.config import Speculative
from jaxserve.engine.warmup import job_of, plan_keys, run_jobs
from jaxserve.errors import ConfigError
from jaxserve.server.metrics import ServerMetrics
from test_engine_sharded import eight_head_model

EMBEDDED = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi"
PIN = dict(min_rows_bucket=8, min_pages_bucket=16, min_chunk_bucket=16)  # max_batch 8, 64 tokens / 4 per page
SERVING = dict(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4")
SP = SamplingParams(max_tokens=24, ignore_eos=True)


def looping(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a short random phrase (n-gram drafts find the phrase's continuation)."""
    return [(p * 4)[:-1] for p in prompts(n, seed, lengths=(3, 5, 4, 6))]


def pair(model, **overrides) -> tuple[Engine, Engine]:  # noqa: ANN001
    """(engine without speculation, the same with ngram:3), shapes pinned."""
    return engine(model, **PIN, **overrides), engine(model, **PIN, speculative="ngram:3", **overrides)


def assert_same(ref: list, got: list, e: Engine) -> None:
    """Same tokens, finish reasons and (to f32 rounding) logprobs; drafts were accepted; every page is back."""
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in ref]
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g.logprobs, r.logprobs, atol=2e-3)
    s = e.stats()
    assert s["accepted_tokens"] > 0 and s["draft_tokens"] >= s["accepted_tokens"]
    assert pool_is_full(e)


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3")


@pytest.mark.parametrize("arch,formats", [("deepseek_v3", {}), ("deepseek_v3", SERVING), ("glm4_moe", SERVING)],
                         ids=["mla-f32", "mla-fp8kv-int4", "gqa-fp8kv-int4"])
def test_greedy_output_is_unchanged(arch, formats, model):
    m = model if arch == "deepseek_v3" else tiny_model(arch)
    plain, spec = pair(m, **formats)
    ps = looping(4, seed=1)
    assert_same(plain.generate(ps, SP), spec.generate(ps, SP), spec)
    assert spec.stats()["verify_rows"] > 0 and spec.programs.compiles["verify"] == 1


# the TPU kernels in the slow tier: test_engine runs them without speculation, and the verify takes the same path
@pytest.mark.parametrize("attention", ["pallas_interpret",
                                       pytest.param("pallas_tpu_interpret", marks=pytest.mark.slow)])
def test_greedy_output_is_unchanged_through_the_pallas_attention_kernels(model, attention):
    plain, spec = pair(model, attention=attention, kv_dtype="fp8")
    ps = looping(2, seed=2)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    assert_same(plain.generate(ps, sp), spec.generate(ps, sp), spec)


def test_preemption_and_a_prefix_hit(model):
    # 12 usable decode pages of 4 tokens for 4 requests wanting up to 10 each: someone is preempted
    plain, spec = pair(model, num_decode_pages=13)
    ps = looping(4, seed=3)  # 11..23 tokens
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    assert_same(plain.generate(ps, sp), spec.generate(ps, sp), spec)
    assert spec.stats()["preemptions"] > 0
    again = ps[0] + [1, 2, 3]  # the first prompt's pages are in the prefix cache
    ref, got = plain.generate([again], sp)[0], spec.generate([again], sp)[0]
    assert got.cached_tokens >= 8 and got.token_ids == ref.token_ids
    assert pool_is_full(spec)


def run_checking_pages(e: Engine, reqs: list[Request], pages) -> list[list[int]]:  # noqa: ANN001
    """Run reqs step by step; after each step every decoding row holds `pages(seq)` pages (an int, or a range
    of allowed counts), mirrored in DecodeRows -> each request's tokens."""
    sched = e.scheduler
    streams = [e.submit(r) for r in reqs]
    while sched.has_work():
        e.step()
        for s in sched.running:
            if s.status.value == "decoding":
                want = pages(s)
                assert len(s.decode_pages) in (want if isinstance(want, range) else (want,))
                assert sched.rows.num_pages[s.slot] == len(s.decode_pages)
    return [[ev.token_id for ev in st if ev.token_id is not None] for st in streams]


def test_rollbacks_across_page_boundaries_return_their_pages(model):
    """After every step each decoding row holds exactly the pages its accepted tokens need; pages taken for
    drafts that were rejected went back while their owner kept decoding; the pools are full at the end. One step
    at a time (overlap off): a chained verify in flight holds the pages it may write (the test below)."""
    plain, spec = pair(model, overlap=False)
    sched, ps = spec.scheduler, spec.cfg.page_size
    returned = []
    free = sched.decode_alloc.free

    def spy(page: int, tag: int) -> None:  # the real free, counted when its owner is still decoding
        owner = [s for s in sched.running if (page, tag) in s.decode_pages]
        returned.extend(s for s in owner if s.status.value == "decoding")
        free(page, tag)

    sched.decode_alloc.free = spy
    reqs = [Request(p, SP) for p in looping(6, seed=4)]
    got = run_checking_pages(spec, reqs, lambda s: math.ceil(s.decode_len / ps))
    assert returned, "no draft page was rolled back: the test does not exercise the path"
    assert got == [o.token_ids for o in plain.generate([r.prompt for r in reqs], SP)]
    assert pool_is_full(spec)
    st = spec.stats()  # and /metrics reports the counters
    text = ServerMetrics(spec).render()[0].decode()
    assert f"jaxserve_spec_draft_tokens_total {float(st['draft_tokens'])}" in text
    assert f"jaxserve_spec_accepted_tokens_total {float(st['accepted_tokens'])}" in text
    mean = (st["accepted_tokens"] + st["verify_rows"]) / st["verify_rows"]
    assert f"jaxserve_spec_mean_accept_length {mean}" in text and mean > 1


@pytest.mark.slow  # ~50 s on a loaded 2-core host; the chain itself runs in every overlapped test here
def test_a_chained_verify_holds_only_the_pages_it_may_write(model):
    """With overlap, n-gram verifies chain (the next dispatched from the one in flight, engine.spec_chain): after
    every step a decoding row holds the pages of its accepted tokens and at most those of the two verifies' worth of
    positions after them; the tokens are the engine's without speculation and the pools are full at the end."""
    plain, spec = pair(model)
    sched, ps, k1 = spec.scheduler, spec.cfg.page_size, 4
    reqs = [Request(p, SP) for p in looping(3, seed=4)]
    got = run_checking_pages(spec, reqs, lambda s: range(math.ceil(s.decode_len / ps),
                                                          math.ceil((s.decode_len + 2 * k1) / ps) + 1))
    assert got == [o.token_ids for o in plain.generate([r.prompt for r in reqs], SP)]
    assert sched.stats.overlapped > 0 and spec.stats()["accepted_tokens"] > 0 and pool_is_full(spec)


def test_a_stale_page_under_a_draft_run_fails_only_its_request(model):
    _, spec = pair(model, kv_dtype="fp8")
    stale_page_fails_only_its_request(spec, looping(3, seed=5), SP)


@pytest.mark.parametrize("sharding", ["tp", "dp_attention"])
def test_eight_devices_equal_one_device_without_speculation(sharding):
    m = eight_head_model("deepseek_v3")
    kw = dict(kv_dtype="fp8", num_decode_pages=128, num_prefill_pages=128)
    ps = looping(3, seed=6)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = engine(m, **PIN, **kw).generate(ps, sp)
    e = engine(m, **PIN, **kw, devices=8, sharding=sharding, speculative="ngram:3")
    assert_same(ref, e.generate(ps, sp), e)


@pytest.fixture(scope="module")
def embedded():
    """The embedded trained model in f32 (its stored precision), plain and speculative, with its tokenizer."""
    cfg = small_config(**{**PIN, "min_pages_bucket": 32}, max_model_len=128)
    spec = dataclasses.replace(cfg, speculative=Speculative("ngram", 3))
    return (Engine.from_checkpoint(EMBEDDED, cfg, start=False), Engine.from_checkpoint(EMBEDDED, spec, start=False))


CODE = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef"


EMBEDDED_PROMPTS = [CODE, "import os\nimport sys\nimport os\n", "for i in range(10):\n    print(i)\nfor i in"]


def test_embedded_model_greedy_output_is_unchanged(embedded):
    plain, spec = embedded
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    assert_same(plain.generate(EMBEDDED_PROMPTS, sp), spec.generate(EMBEDDED_PROMPTS, sp), spec)


@pytest.mark.xfail(strict=True, reason=(
    "known gap: with bf16 activations the verify chunk's logits differ from decode's by an ulp of bf16 at every "
    "position (first differing greedy token at 2-14 on these prompts, over an FP8 or a bf16 pool): the chunk runs "
    "another computation than decode (prefill attention kernel, the MoE's algorithm for 32 tokens instead of 8, "
    "XLA:CPU kernels shaped by [B, k + 1] rows); f32 keeps the gap at ~1e-6 (exact greedy); decode bodies per "
    "position are bit-exact at ~2.5x the verify's cost (test_verify_numerics.py)"))
def test_embedded_model_in_bf16_serving_formats_greedy_output_is_unchanged():
    """What `serve` runs: bf16 activations, FP8 KV, FP8 prefill / INT4 decode weights."""
    cfg = small_config(**{**PIN, "min_pages_bucket": 32}, max_model_len=128, dtype="bf16", **SERVING)
    plain = Engine.from_checkpoint(EMBEDDED, cfg, start=False)
    spec = Engine.from_checkpoint(EMBEDDED, dataclasses.replace(cfg, speculative=Speculative("ngram", 3)), start=False)
    # one verify read at a time, where these prompts show the gap; chained (engine.spec_chain) other steps verify and
    # these 3 prompts happen to match, while the bench's do not (bench/results/speculative_chain.json: 0/1, 7/16)
    spec.scheduler._speculation.chains = False
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    ref, got = plain.generate(EMBEDDED_PROMPTS, sp), spec.generate(EMBEDDED_PROMPTS, sp)
    assert spec.stats()["accepted_tokens"] > 0 and pool_is_full(spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_a_stop_string_inside_an_accepted_run(embedded):
    plain, spec = embedded
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    # find a token the speculative engine emitted second in a verify step that emitted 3 or more: stopping there
    # drops the rest of that step's run
    stream = spec.submit(Request(spec.encode(CODE), sp))
    sched, steps = spec.scheduler, []
    while sched.has_work():
        seq = next((s for s in sched.running if s.status.value == "decoding"), None)
        before = len(seq.generated) if seq is not None else None
        spec.step()
        if seq is not None:
            steps.append((before, len(seq.generated)))
    text = [ev.text for ev in stream]
    j = next(b + 1 for b, a in steps if a - b >= 3 and text[b + 1].strip())  # in-run token with visible text
    full = "".join(text[: j + 1])
    # the shortest tail of the text up to token j that occurs nowhere before: the stop string completes at token j
    stop = next(full[-n:] for n in range(1, len(full) + 1) if full.find(full[-n:]) == len(full) - n)
    stopped = SamplingParams(max_tokens=48, ignore_eos=True, stop=(stop,))
    ref, got = plain.generate([CODE], stopped)[0], spec.generate([CODE], stopped)[0]
    assert got.finish_reason == ref.finish_reason == "stop"
    assert got.token_ids == ref.token_ids and got.text == ref.text and stop not in got.text
    assert pool_is_full(spec)


def test_warmup_compiles_the_verify_grid_and_nothing_recompiles(model):
    """The greedy form's warm-up plan (verify grid, its unpacking and its device chain steps included) leaves
    nothing for chained n-gram verifies to compile: no backend compile while they run."""
    jax.clear_caches()  # drop the module's earlier programs: this grid (~13k mappings) alone must fit the mapping budget
    e = engine(model, speculative="ngram:2")
    assert e.cfg.program_count()["verify"] == e.cfg.program_count()["decode"]
    keys = [k for k in plan_keys(e.programs) if k[4] in ("", "greedy") and k[0] != "prefill_scored"]
    assert {k[1:3] for k in keys if k[0] == "chain"} == {k[1:3] for k in keys if k[0] == "verify"}
    run_jobs("full", [job_of(e.programs, k) for k in keys], False)
    before = dict(e.programs.compiles)
    assert before["verify"] == e.cfg.program_count()["verify"]
    with backend_compiles() as compiles:
        e.generate(looping(5, seed=7), SamplingParams(max_tokens=12, ignore_eos=True))
    assert e.stats()["accepted_tokens"] > 0 and dict(e.programs.compiles) == before and compiles == []


def events(e: Engine, reqs: list[Request]) -> list[list]:
    streams = [e.submit(r) for r in reqs]
    return [[ev for ev in st if ev.token_id is not None] for st in streams]


def test_top_logprobs_and_penalty_rows_beside_speculating_rows(model):
    """A greedy row with top logprobs speculates (its alternatives come from the verify program); a row with a
    presence penalty takes the plain decode program in the same steps; both equal the engine without speculation."""
    plain, spec = pair(model)
    ps = looping(3, seed=8)
    params = [SP, SamplingParams(max_tokens=24, ignore_eos=True, top_logprobs=3, logprobs=True),
              SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.5)]
    ref = events(plain, [Request(p, sp) for p, sp in zip(ps, params)])
    got = events(spec, [Request(p, sp) for p, sp in zip(ps, params)])
    assert [[ev.token_id for ev in r] for r in got] == [[ev.token_id for ev in r] for r in ref]
    for r, g in zip(ref[1], got[1]):
        assert [t for t, _ in g.top_logprobs] == [t for t, _ in r.top_logprobs] and len(g.top_logprobs) == 3
        np.testing.assert_allclose([lp for _, lp in g.top_logprobs], [lp for _, lp in r.top_logprobs], atol=2e-3)
    assert spec.stats()["accepted_tokens"] > 0 and pool_is_full(spec)


def test_sampled_rows_speculate_and_a_seed_reproduces_them(model):
    """Seeded sampled rows speculate (the acceptance rule keeps the target's distribution: tests/engine/
    test_acceptance.py); a seed gives the same tokens alone and beside other rows, other seeds other tokens."""
    _, spec = pair(model)
    p, other = looping(2, seed=9)
    sp = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, seed=5)
    alone = spec.generate([p], sp)[0].token_ids
    assert spec.stats()["verify_rows"] > 0
    assert spec.generate([p, other], [sp, SP])[0].token_ids == alone
    seeds = {tuple(spec.generate([p], SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, seed=s))[0]
                   .token_ids) for s in range(3)}
    assert len(seeds) > 1 and pool_is_full(spec)


def test_above_max_rows_the_plain_overlapped_decode_runs(model):
    """ngram:3:2: while more than 2 rows decode the plain decode runs (overlapped), then the last rows speculate;
    the tokens are the engine's without speculation."""
    plain, capped = engine(model, **PIN), engine(model, **PIN, speculative="ngram:3:2")
    ps = looping(4, seed=10)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 10, 24, 24)]
    assert_same(plain.generate(ps, params), capped.generate(ps, params), capped)
    assert capped.stats()["verify_rows"] > 0 and capped.scheduler.stats.overlapped > 0


def test_speculative_config_is_parsed_and_checked():
    assert EngineConfig(speculative="ngram:3").speculative == Speculative("ngram", 3)
    assert EngineConfig(speculative="ngram:2:8").speculative == Speculative("ngram", 2, max_rows=8)
    for bad in ("ngram", "ngram:x", "eagle:3", "ngram:0", "ngram:99", "ngram:3:0", "ngram:3:x", "ngram:3:4:5"):
        with pytest.raises(ConfigError) as err:
            EngineConfig(speculative=bad)
        assert err.value.param == "speculative"
