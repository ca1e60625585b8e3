"""The general sampling form (engine/sampling_forms.py): the same tokens, logprobs and top alternatives as the
specialised programs for every row kind (greedy, top-k, top-p, seeded; penalties, biases, masks, top logprobs), in
one compiled program whatever the batch asks for; verify's acceptance alike."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.acceptance import verify_tokens
from jaxserve.engine.request import MAX_LOGIT_BIAS
from jaxserve.engine.sampling import LogitAdjust, SamplingArrays, sample, sampling_mode
from jaxserve.engine.sampling_forms import SamplingForms, plain_greedy
from test_sampling import CASES, V, arrays, logits_for

HISTORY = 24
FORMS = SamplingForms(V, HISTORY)
traces = {"sample": 0}


@jax.jit
def run(logits: jax.Array, s: SamplingArrays):  # noqa: ANN201
    traces["sample"] += 1
    return sample(logits, s)


def extras(trial: int, B: int) -> tuple[LogitAdjust, np.ndarray]:
    """Host extras at a trial-dependent width (as `batch.sampling_extras` makes them): penalties and biases on
    some rows, a grammar-like mask on one."""
    rng = np.random.default_rng(trial)
    L, K = 3 + trial % 5, 1 + trial % 3
    history = np.where(rng.random((B, L)) < 0.8, rng.integers(0, V, (B, L)), -1).astype(np.int32)
    history[trial % B] = -1  # a neutral row among adjusted ones
    a = LogitAdjust(history, np.full(B, 2, np.int32), rng.uniform(1.0, 1.5, B).astype(np.float32),
                    rng.uniform(0, 0.5, B).astype(np.float32), rng.uniform(0, 0.5, B).astype(np.float32),
                    rng.integers(-1, V, (B, K)).astype(np.int32), rng.uniform(-5, 5, (B, K)).astype(np.float32))
    mask = np.full((B, (V + 31) // 32), -1, np.int32)
    mask[(trial + 1) % B, : V // 64] = 0  # that row may not pick the first half of the vocabulary
    return a, mask


def with_extras(s: SamplingArrays, adjust: LogitAdjust | None, mask: np.ndarray | None, top_n: int
                ) -> SamplingArrays:
    dev = None if adjust is None else jax.tree.map(jnp.asarray, adjust)
    return SamplingArrays(s.temperature, s.top_k, s.top_p, s.seed, s.step, dev,
                          None if mask is None else jnp.asarray(mask), mode=s.mode, top_n=top_n)


@pytest.mark.parametrize("rows,mode", CASES)
@pytest.mark.parametrize("kind", ["plain", "extras", "top"])
def test_general_form_samples_as_the_specialised_programs(rows, mode, kind):
    assert sampling_mode(rows) == mode
    for trial in range(6):
        logits = logits_for(200 + trial, len(rows), peaked=trial % 2 == 0)
        s = arrays(rows, seeds=[3 + trial, 77, 5, trial], step=trial)
        adjust, mask = extras(trial, len(rows)) if kind == "extras" else (None, None)
        top_n = 20 if kind == "top" else 0
        want = run(logits, with_extras(s, adjust, mask, top_n))
        host = SamplingArrays(s.temperature, s.top_k, s.top_p, s.seed, s.step, adjust, mask, mode=mode, top_n=top_n)
        general = FORMS.general(host, None)
        assert general.mode == "any" and general.top_n == 20 and general.adjust.history.shape == (len(rows), HISTORY)
        got = run(logits, general)
        for field in ("tokens", "logprobs"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))
        if top_n:
            np.testing.assert_array_equal(np.asarray(got.top_ids), np.asarray(want.top_ids))
            np.testing.assert_array_equal(np.asarray(got.top_logprobs), np.asarray(want.top_logprobs))
        else:
            assert not np.asarray(got.top_ids).any()  # not computed: zeros


def test_one_program_serves_every_batch():
    """Whatever extras and widths a batch has, its general form traces (and compiles) one program per rows."""
    before = traces["sample"]
    logits = logits_for(1, 4, peaked=False)
    for trial in range(5):
        rows = [(0.0, 0, 1.0)] * 4 if trial == 0 else [(1.0, 5 * trial, 0.9), (0.0, 0, 1.0)] * 2
        s = arrays(rows, seeds=[1, 2, 3, 4], step=trial)
        adjust, mask = extras(trial, 4)
        host = SamplingArrays(s.temperature, s.top_k, s.top_p, s.seed, s.step, adjust if trial % 2 else None,
                              mask if trial > 2 else None, mode=sampling_mode(rows), top_n=20 * (trial % 2))
        run(logits, FORMS.general(host, None))
    assert traces["sample"] - before <= 1  # one trace (none if an earlier test traced this shape)
    assert plain_greedy(arrays([(0.0, 0, 1.0)] * 4, [0] * 4, 0))
    assert not plain_greedy(FORMS.general(arrays([(0.0, 0, 1.0)] * 4, [0] * 4, 0), None))


def test_widths_past_the_fixed_ones_are_refused():
    s = arrays([(0.0, 0, 1.0)], [0], 0)
    wide = LogitAdjust(np.zeros((1, HISTORY + 1), np.int32), *(np.zeros(1, np.float32),) * 4,
                       np.zeros((1, MAX_LOGIT_BIAS), np.int32), np.zeros((1, MAX_LOGIT_BIAS), np.float32))
    with pytest.raises(ValueError, match="exceed"):
        FORMS.general(SamplingArrays(s.temperature, s.top_k, s.top_p, s.seed, s.step, wide), None)


@pytest.mark.parametrize("sampled", [False, True])
def test_verify_in_the_general_form_accepts_as_the_specialised_program(sampled):
    B, K = 4, 3
    rows = [(1.0, 0, 0.9), (0.0, 0, 1.0), (0.8, 8, 1.0), (1.2, 0, 1.0)] if sampled else [(0.0, 0, 1.0)] * B
    verify = jax.jit(verify_tokens)
    for trial in range(4):
        logits = jax.random.normal(jax.random.key(trial), (B, K + 1, V)) * 3
        drafts = jnp.asarray(np.random.default_rng(trial).integers(0, V, (B, K)), jnp.int32)
        drafts = drafts.at[:, 0].set(jnp.argmax(logits[:, 0], -1))  # some drafts are accepted
        s = arrays(rows, seeds=[trial, 1, 2, 3], step=trial)
        adjust, mask = extras(trial, B)
        want = verify(logits, drafts, None, with_extras(s, adjust, mask, 20))
        host = SamplingArrays(s.temperature, s.top_k, s.top_p, s.seed, s.step, adjust, mask, mode=s.mode, top_n=20)
        got = verify(logits, drafts, None, FORMS.general(host, None))
        for field in ("tokens", "count", "logprobs", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))
