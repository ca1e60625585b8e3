"""Prompt logprobs from the prefill program (SamplingParams.prompt_logprobs): equal to the full-sequence forward's
log-softmax, chunked, with and without a prefix-cache hit, with top-k; max_tokens 0 scores only; requests
without them never run the scoring program."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_util import engine, pool_is_full, prompts, tiny_model
from jaxserve.engine import SamplingParams
from jaxserve.errors import InvalidRequestError
from jaxserve.models import forward

TOL = 1e-4  # f32 weights and KV pools: the paged prefill and the plain forward differ in summation order only


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def reference(model, prompt: list[int]) -> np.ndarray:
    """log-softmax of the full-sequence forward: [len, V] f32, row t the distribution after prompt[:t + 1]."""
    row = np.zeros((1, 64), np.int32)
    row[0, : len(prompt)] = prompt
    logits = forward(model, jnp.asarray(row), lengths=jnp.asarray([len(prompt)], jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits[0, : len(prompt)].astype(jnp.float32), axis=-1))


def check_against(model, prompt: list[int], scores, k: int) -> None:
    ref = reference(model, prompt)
    assert scores.logprobs[0] is None and scores.top[0] == ()
    want = np.array([ref[t - 1, prompt[t]] for t in range(1, len(prompt))])
    got = np.array(scores.logprobs[1:], np.float64)
    assert np.abs(got - want).max() < TOL, np.abs(got - want).max()
    for t in range(1, len(prompt)):
        ids = [i for i, _ in scores.top[t]]
        assert len(ids) == k
        if k:
            np.testing.assert_allclose([lp for _, lp in scores.top[t]], ref[t - 1, ids], atol=TOL)
            assert np.sort(ref[t - 1])[-k:].min() <= min(lp for _, lp in scores.top[t]) + TOL


def test_chunked_prompt_matches_forward_then_cache_hit(model):
    e = engine(model, kv_dtype="f32")  # prefill_chunk 16: the 40-token prompt takes three chunks
    prompt = prompts(1, seed=3, lengths=(40,))[0]
    first = e.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert first.token_ids == [] and first.finish_reason == "length" and first.cached_tokens == 0
    check_against(model, prompt, first.prompt_logprobs, 2)
    # a plain request fills the prefix cache ...
    plain = e.generate([prompt + [7]], SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.cached_tokens > 0
    # ... and a scoring one that would hit it recomputes its prompt: the same values
    again = e.generate([prompt + [7]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert again.cached_tokens == 0 and len(again.token_ids) == 1
    check_against(model, prompt + [7], again.prompt_logprobs, 0)
    np.testing.assert_allclose(np.array(again.prompt_logprobs.logprobs[1:40], np.float64),
                               np.array(first.prompt_logprobs.logprobs[1:], np.float64), atol=TOL)
    assert pool_is_full(e)


def test_mixed_batch_and_plain_requests_skip_the_scoring_program(model):
    e = engine(model, kv_dtype="f32")
    plain = e.generate(prompts(3, seed=5), SamplingParams(max_tokens=3))
    assert e.programs.compiles["prefill_scored"] == 0 and all(o.prompt_logprobs is None for o in plain)
    ps = prompts(4, seed=6)
    params = [SamplingParams(max_tokens=2, prompt_logprobs=1 if i % 2 else None) for i in range(4)]
    outs = e.generate(ps, params)
    for p, sp, out in zip(ps, params, outs):
        assert len(out.token_ids) == 2
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert len(out.prompt_logprobs.logprobs) == len(p)
            check_against(model, p, out.prompt_logprobs, 1)
    assert pool_is_full(e)


def test_one_token_prompt_and_bad_values(model):
    e = engine(model, kv_dtype="f32")
    out = e.generate([[5]], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.prompt_logprobs.logprobs == (None,) and out.token_ids == []
    for bad in (-1, 21, True):
        with pytest.raises(InvalidRequestError) as err:
            e.generate([[5, 6]], SamplingParams(prompt_logprobs=bad))
        assert err.value.param == "prompt_logprobs"
