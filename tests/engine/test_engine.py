"""The engine: continuous batching correctness, prefix cache, preemption, integrity aborts, sampling, recompiles."""
from __future__ import annotations

import pytest
from flax import nnx

from engine_util import engine, greedy_reference, pool_is_full, prompts, tiny_model
from jaxserve.engine import Request, SamplingParams
from jaxserve.errors import InvalidRequestError, KVIntegrityError

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3")


@pytest.fixture(scope="module")
def eng(model):
    return engine(model)


def test_greedy_matches_full_sequence_forward(model, eng):
    ps = prompts(3)
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs):
        assert o.token_ids == greedy_reference(model, p, GREEDY.max_tokens)
        assert o.finish_reason == "length"
    assert pool_is_full(eng)


def test_concurrent_equals_each_alone(eng):
    ps = prompts(6, seed=1)
    together = eng.generate(ps, GREEDY)
    alone = [eng.generate([p], GREEDY)[0] for p in ps]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert pool_is_full(eng)


def test_gqa_model_through_the_engine():
    m = tiny_model("glm4_moe")
    e = engine(m, kv_dtype="fp8")
    ps = prompts(2, seed=2)
    outs = e.generate(ps, GREEDY)
    agree = sum(a == b for p, o in zip(ps, outs) for a, b in zip(o.token_ids, greedy_reference(m, p, 6)))
    assert agree >= 10  # FP8 KV: near-ties may flip, most tokens must agree (12 total)
    assert pool_is_full(e)


def test_prefix_cache_reports_cached_tokens_and_same_output(model, eng):
    shared = prompts(1, seed=3, lengths=(40,))[0]
    a, b = shared + [1, 2, 3], shared + [7, 8]
    first = eng.generate([a], GREEDY)[0]
    second = eng.generate([b], GREEDY)[0]
    assert first.cached_tokens == 0 or first.cached_tokens % 4 == 0
    assert second.cached_tokens >= 36  # full 4-token pages of the shared 40-token prefix
    no_cache = engine(model, prefix_cache=False)
    assert [o.token_ids for o in no_cache.generate([a, b], GREEDY)] == [first.token_ids, second.token_ids]
    assert pool_is_full(eng) and pool_is_full(no_cache)


def test_preemption_under_a_tiny_pool(model):
    # 12 usable decode pages of 4 tokens, 4 requests wanting up to 10 pages each: preemption must happen (the
    # deterministic default admits only what fits to the end, so it never preempts: this is the other policy)
    e = engine(model, num_decode_pages=13, deterministic=False)
    ps = prompts(4, seed=4, lengths=(14, 10, 12, 9))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = e.generate(ps, params)
    assert e.stats()["preemptions"] > 0
    for p, o in zip(ps, outs):
        assert o.token_ids == greedy_reference(model, p, 24)
    assert pool_is_full(e)


def test_no_recompiles_after_warmup(eng):
    eng.programs.warmup(progress=False)
    before = dict(eng.programs.compiles)
    assert before["decode"] >= len(eng.cfg.row_buckets) * len(eng.cfg.page_buckets)
    eng.generate(prompts(5, seed=5), GREEDY)
    eng.generate(prompts(8, seed=6, lengths=(40, 2, 33, 7)), SamplingParams(max_tokens=12, ignore_eos=True))
    assert dict(eng.programs.compiles) == before


def test_integrity_fault_aborts_only_that_request(model):
    e = engine(model, kv_dtype="fp8")
    ps = prompts(3, seed=6)
    clean = e.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True))
    reqs = [Request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in ps]
    streams = [e.submit(r) for r in reqs]
    sched = e.scheduler
    while sum(s.status.value == "decoding" for s in sched.running) < 3:
        e.step()
    victim = next(s for s in sched.running if s.req.request_id == reqs[1].request_id)
    page, tag = victim.decode_pages[0]
    sched.decode_alloc.free(page, tag)  # a stale mapping: the page goes back and is handed to someone else
    [(new_page, new_tag)] = sched.decode_alloc.allocate(1)
    assert new_page == page and new_tag != tag
    events = [list(s) for s in streams]
    ends = [ev[-1] for ev in events]
    assert ends[1].finish_reason == "error" and isinstance(ends[1].error, KVIntegrityError)
    assert ends[1].error.value == reqs[1].request_id
    for i in (0, 2):
        assert [ev.token_id for ev in events[i] if ev.token_id is not None] == clean[i].token_ids
    assert e.stats()["tag_mismatches"] == 1
    sched.decode_alloc.free(new_page, new_tag)
    assert pool_is_full(e)


def test_seeded_sampling_is_reproducible(eng):
    p = prompts(1, seed=7)[0]
    sp = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = eng.generate([p], sp)[0].token_ids
    b = eng.generate([p, prompts(1, seed=8)[0]], sp)[0].token_ids  # other rows in the batch change nothing
    assert a == b
    others = {tuple(eng.generate([p], SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True))[0]
                    .token_ids) for s in range(4)}
    assert len(others) > 1


def test_stop_token_and_abort(model, eng):
    p = prompts(1, seed=9)[0]
    ref = greedy_reference(model, p, 6)
    out = eng.generate([p], SamplingParams(max_tokens=6, stop_token_ids=(ref[2],), ignore_eos=True))[0]
    assert out.token_ids == ref[: ref.index(ref[2]) + 1] and out.finish_reason == "stop"
    stream = eng.submit(Request(p, SamplingParams(max_tokens=50, ignore_eos=True)))
    first = next(stream)
    assert first.token_id is not None
    eng.abort(first.request_id)
    assert list(stream)[-1].finish_reason == "abort"
    assert pool_is_full(eng)


def test_bad_requests_are_refused_and_lose_nothing(eng):
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.submit(Request([], GREEDY))
    with pytest.raises(InvalidRequestError) as e:
        eng.submit(Request([1, 999], GREEDY))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="context window"):
        eng.submit(Request([1] * 64, GREEDY))
    with pytest.raises(InvalidRequestError) as e:
        eng.submit(Request([1, 2], SamplingParams(max_tokens=0)))
    assert e.value.param == "max_tokens"
    assert eng.stats()["waiting"] == 0 and pool_is_full(eng)


def test_a_request_larger_than_the_pool_is_refused(model):
    e = engine(model, num_decode_pages=5)  # 4 usable pages of 4 tokens
    with pytest.raises(InvalidRequestError, match="KV pages"):
        e.submit(Request(list(range(10)), SamplingParams(max_tokens=20)))
    assert e.generate([list(range(6))], SamplingParams(max_tokens=4, ignore_eos=True))[0].finish_reason == "length"


# the Triton kernels' case in the slow tier (CI time): test_engine_with_the_pallas_int4_and_moe_kernels runs the
# engine through them too, and tests/kernels checks them against the reference at every shape
@pytest.mark.parametrize("attention", [pytest.param("pallas_interpret", marks=pytest.mark.slow), "pallas_tpu_interpret"])
def test_engine_through_the_pallas_attention_kernels(model, attention):
    """The prefill and decode programs with the Pallas attention kernels (flash prefill over pages, paged decode;
    interpret mode on CPU) give the XLA paths' tokens."""
    ps = prompts(2, seed=13)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    ref = [o.token_ids for o in engine(model, kv_dtype="fp8").generate(ps, sp)]
    got = [o.token_ids for o in engine(model, kv_dtype="fp8", attention=attention).generate(ps, sp)]
    assert got == ref


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["pallas_interpret", "pallas_tpu_interpret"])
def test_gqa_engine_through_the_pallas_attention_kernels(attention):
    m = tiny_model("glm4_moe")
    ps = prompts(2, seed=15)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    ref = [o.token_ids for o in engine(m).generate(ps, sp)]
    assert [o.token_ids for o in engine(m, attention=attention).generate(ps, sp)] == ref


def test_engine_with_the_pallas_int4_and_moe_kernels(model):
    """INT4 decode weights through the Pallas INT4 matmul / grouped MoE kernels (interpret) vs the XLA dequant path."""
    ps = prompts(2, seed=14)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    kw = dict(kv_dtype="fp8", decode_weights="int4", prefill_weights="fp8")
    ref = engine(model, **kw).generate(ps, sp)
    e = engine(model, use_kernels=True, attention="pallas_interpret", **kw)
    ph = e.programs.decode_phase
    experts = [m for _, m in nnx.iter_graph(nnx.merge(ph.graphdef, ph.state)) if type(m).__name__ == "Experts"]
    assert experts and all(m.use_kernel and m.fmt == "int4" for m in experts)
    got = e.generate(ps, sp)
    agree = sum(a == b for r, g in zip(ref, got) for a, b in zip(r.token_ids, g.token_ids))
    assert agree >= 5  # bf16 operands in the kernels vs f32 dequant in XLA: a near-tie may flip one of 6
