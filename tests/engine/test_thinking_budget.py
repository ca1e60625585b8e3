"""The per-request thinking budget (`SamplingParams.thinking_budget`, engine.budget): after N generated tokens that
do not contain end_ids, end_ids are forced one per step whatever the model would sample, with the model's own
logprobs, then generation goes on; nothing is forced when the model closes the block first; overlap is exact.

Every program runs at one shape (`batch_invariant_buckets`), so the free-running reference and the budgeted run
share their tokens up to the budget (see engine.sampling's "Seeds and batches")."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_util import pool_is_full, prompts, small_config, tiny_model
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.sampling import batch_invariant_buckets
from jaxserve.errors import InvalidRequestError
from jaxserve.models import CausalLM, forward

MAX = 12


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def eng(model):
    cfg = small_config(num_decode_pages=128, num_prefill_pages=128)
    return Engine(model, dataclasses.replace(cfg, **batch_invariant_buckets(cfg)), start=False)


def free_run(e: Engine, prompt: list[int], **kw: object) -> list[int]:
    return e.generate([prompt], SamplingParams(max_tokens=MAX, **kw))[0].token_ids


def unused(e: Engine, tokens: list[int], n: int) -> tuple[int, ...]:
    """n token ids that do not occur in `tokens` and end nothing."""
    return tuple(t for t in range(1000) if t not in tokens and t not in e.scheduler.eos)[:n]


def model_logprob(model: CausalLM, tokens: list[int], nxt: int) -> float:
    """log p(nxt | tokens) by the full-sequence forward."""
    row = np.zeros((1, 64), np.int32)
    row[0, :len(tokens)] = tokens
    logits = forward(model, jnp.asarray(row), lengths=jnp.asarray([len(tokens)], jnp.int32))
    return float(jax.nn.log_softmax(np.asarray(logits)[0, len(tokens) - 1])[nxt])


@pytest.mark.parametrize("n", [0, 3])
def test_budget_forces_the_end_after_n_tokens(eng, model, n):
    prompt = prompts(1, seed=3)[0]
    free = free_run(eng, prompt)
    end = unused(eng, free, 2)
    out = eng.generate([prompt], SamplingParams(max_tokens=MAX, thinking_budget=(n, end)))[0]
    assert out.token_ids[:n] == free[:n]
    assert tuple(out.token_ids[n:n + 2]) == end
    assert len(out.token_ids) == MAX and out.finish_reason == "length"  # the answer goes on after the end
    # a forced token's logprob is the model's own for it (the mask only chose it)
    assert out.logprobs[n] == pytest.approx(model_logprob(model, prompt + free[:n], end[0]), abs=1e-3)
    assert pool_is_full(eng)


def test_budget_forces_the_end_whatever_is_sampled(eng):
    prompt = prompts(2, seed=4)[1]
    params = dict(temperature=1.0, seed=7)
    free = free_run(eng, prompt, **params)
    end = unused(eng, free, 2)
    out = eng.generate([prompt], SamplingParams(max_tokens=MAX, thinking_budget=(4, end), **params))[0]
    assert out.token_ids[:4] == free[:4] and tuple(out.token_ids[4:6]) == end
    assert pool_is_full(eng)


def test_nothing_is_forced_when_the_model_ends_the_thinking_first(eng):
    prompt = prompts(1, seed=5)[0]
    free = free_run(eng, prompt)
    # the model's own token 1 is the end: the block closed before the budget of 3, the output is untouched
    out = eng.generate([prompt], SamplingParams(max_tokens=MAX, thinking_budget=(3, (free[1],))))[0]
    assert out.token_ids == free
    # a logit_bias makes the model write the end token itself at once; a budget of 2 then forces nothing more
    x, y = unused(eng, free, 2)
    biased = SamplingParams(max_tokens=MAX, logit_bias=((x, 100.0),))
    ref = eng.generate([prompt], biased)[0].token_ids
    assert ref[0] == x
    out = eng.generate([prompt], dataclasses.replace(biased, thinking_budget=(2, (x,))))[0]
    assert out.token_ids == ref and y not in out.token_ids
    assert pool_is_full(eng)


def test_a_partly_written_end_is_completed_not_repeated(eng):
    prompt = prompts(1, seed=6)[0]
    free = free_run(eng, prompt)
    (z,) = unused(eng, free, 1)
    # the last token within the budget of 3 is the end's first: only the rest is forced
    out = eng.generate([prompt], SamplingParams(max_tokens=MAX, thinking_budget=(3, (free[2], z))))[0]
    assert out.token_ids[:4] == free[:3] + [z]


def test_budget_with_overlap_and_other_rows(eng):
    """Overlap on (the default): the budgeted row runs one step at a time while its budget is open, overlapped
    after; the other rows' results are those of a run without it."""
    assert eng.cfg.overlap
    ps = prompts(4, seed=8)
    plain = SamplingParams(max_tokens=MAX)
    alone = eng.generate(ps[1:], plain)
    free = free_run(eng, ps[0])
    end = unused(eng, free, 2)
    before = eng.scheduler.stats.overlapped
    outs = eng.generate(ps, [SamplingParams(max_tokens=MAX, thinking_budget=(2, end))] + [plain] * 3)
    assert outs[0].token_ids[:2] == free[:2] and tuple(outs[0].token_ids[2:4]) == end
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in alone]
    assert eng.scheduler.stats.overlapped > before  # steps after the budget closed were dispatched ahead
    assert pool_is_full(eng)


@pytest.mark.parametrize("bad", [(-1, (5,)), (2, ()), (2, (10**9,)), (True, (5,))])
def test_bad_budget_is_refused(eng, bad):
    with pytest.raises(InvalidRequestError) as err:
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=4, thinking_budget=bad))
    assert err.value.param == "thinking_budget"
