"""Sampling fast paths: the greedy / top-k / full programs draw exactly the tokens of sorting the whole vocabulary
(the implementation before the fast paths, kept here as the reference), and the host picks the cheapest program."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.sampling import TOP_K_BOUND, SamplingArrays, fits_top_k, first_argmax, sample, sampling_mode

V = 300  # > TOP_K_BOUND, so the top-k path really drops candidates


def sample_reference(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """The sort-everything sampler the engine shipped before the fast paths (verbatim)."""
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    V = logits.shape[-1]
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = jnp.where(s.top_k[:, None] > 0, rank < s.top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (before < s.top_p[:, None])
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(s.seed, s.step)
    pick = jax.vmap(jax.random.categorical)(keys, filtered)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(s.temperature > 0, sampled, greedy)
    return tokens, jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]


def arrays(rows: list[tuple[float, int, float]], seeds: list[int], step: int, mode: str | None = None
           ) -> SamplingArrays:
    t, k, p = (np.array(c) for c in zip(*rows))
    return SamplingArrays(jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32),
                          jnp.asarray(seeds, jnp.uint32), jnp.full(len(rows), step, jnp.int32),
                          mode=mode or sampling_mode(rows))


def logits_for(seed: int, batch: int, peaked: bool) -> jax.Array:
    """Random logits; `peaked` concentrates the mass on a few tokens (a top-p nucleus inside the top 64)."""
    x = jax.random.normal(jax.random.key(seed), (batch, V)) * (6.0 if peaked else 1.0)
    return x.astype(jnp.float32)


SAMPLE = jax.jit(lambda logits, s: (lambda o: (o.tokens, o.logprobs))(sample(logits, s)))
REFERENCE = jax.jit(sample_reference)

# (rows of (temperature, top_k, top_p), expected mode)
CASES = [
    ([(0.0, 0, 1.0)] * 4, "greedy"),
    ([(0.0, 0, 1.0), (1.0, 50, 1.0), (0.7, 5, 0.9), (1.3, 64, 0.5)], "top_k"),
    ([(1.0, 1, 1.0), (2.0, 2, 0.3), (0.5, 64, 0.99), (0.0, 7, 0.5)], "top_k"),
    ([(1.0, 0, 0.9), (0.8, 0, 0.5), (0.0, 0, 1.0), (1.0, 40, 0.95)], "full"),  # top-p-only rows
    ([(1.0, 0, 1.0), (1.0, 200, 1.0), (0.9, 0, 0.95), (0.0, 0, 1.0)], "full"),  # needs the sort
]


@pytest.mark.parametrize("rows,mode", CASES)
@pytest.mark.parametrize("peaked", [False, True])
def test_tokens_equal_the_sort_everything_sampler(rows, mode, peaked):
    assert sampling_mode(rows) == mode
    for trial in range(12):
        logits = logits_for(100 + trial, len(rows), peaked)
        s = arrays(rows, seeds=[7 + trial, 1234, 99, trial], step=trial)
        want_t, want_lp = REFERENCE(logits, s)
        for m in {mode, "full"}:  # the chosen program, and the general one on the same rows
            got_t, got_lp = SAMPLE(logits, arrays(rows, [7 + trial, 1234, 99, trial], trial, mode=m))
            np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want_t), err_msg=f"{m} trial {trial}")
            np.testing.assert_array_equal(np.asarray(got_lp), np.asarray(want_lp))


def test_first_argmax_is_jnp_argmax():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, V)).astype(np.float32)
    x[1] = np.repeat(np.arange(V // 4, dtype=np.float32), 4)  # ties: the first maximum wins
    x[2, [17, 40]] = np.nan  # the first NaN wins, as in jnp.argmax
    x[3] = -np.inf  # every token masked
    x[4, [5, 250]] = np.inf
    x[5] = 0.0
    want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
    got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert list(got[1:6]) == [V - 4, 17, 0, 5, 0]


def test_tied_logits_break_ties_like_the_stable_sort():
    logits = jnp.asarray(np.repeat(np.arange(V // 4, dtype=np.float32) / 10, 4)[None].repeat(4, 0))
    rows = [(1.0, 3, 1.0), (1.0, 8, 1.0), (2.0, 64, 0.7), (0.5, 2, 1.0)]
    for step in range(20):
        s = arrays(rows, seeds=[1, 2, 3, 4], step=step)
        np.testing.assert_array_equal(np.asarray(SAMPLE(logits, s)[0]), np.asarray(REFERENCE(logits, s)[0]))


def test_full_mode_takes_the_top_k_branch_only_when_the_candidates_fit():
    peaked, flat = logits_for(1, 4, True), logits_for(1, 4, False)
    top_p_rows = [(1.0, 0, 0.9)] * 4
    s = arrays(top_p_rows, [0] * 4, 0)
    assert np.asarray(fits_top_k(peaked * 1.0, s, TOP_K_BOUND)).all()
    assert not np.asarray(fits_top_k(flat, s, TOP_K_BOUND)).any()  # 300 near-equal tokens: nucleus > 64
    pure = arrays([(1.0, 0, 1.0), (0.0, 0, 1.0), (1.0, 65, 1.0), (1.0, 64, 1.0)], [0] * 4, 0)
    np.testing.assert_array_equal(np.asarray(fits_top_k(peaked, pure, TOP_K_BOUND)), [False, True, False, True])


def test_sampling_mode_is_the_cheapest_exact_program():
    assert sampling_mode([]) == "greedy"
    assert sampling_mode([(0.0, 100, 0.5)]) == "greedy"  # filters do not matter at temperature 0
    assert sampling_mode([(0.1, TOP_K_BOUND, 1.0)]) == "top_k"
    assert sampling_mode([(0.1, TOP_K_BOUND + 1, 1.0)]) == "full"
    assert sampling_mode([(0.1, 0, 0.9)]) == "full"


def _ops(mode: str) -> str:
    rows = [(0.0, 0, 1.0)] * 4 if mode == "greedy" else [(1.0, 8, 1.0)] * 4
    return SAMPLE.lower(logits_for(0, 4, False), arrays(rows, [0] * 4, 0, mode=mode)).compile().as_text()


def test_greedy_and_top_k_programs_have_no_sort():
    assert " sort(" in _ops("full")  # negative control: the general program sorts
    greedy, top_k = _ops("greedy"), _ops("top_k")
    assert " sort(" not in greedy and "TopK" not in greedy and "threefry" not in greedy  # an argmax, no noise
    assert " sort(" not in top_k and 'custom_call_target="TopK"' in top_k


# ---- logit adjustments, grammar masks, top logprobs ------------------------------------------------------------
def adjust_reference(logits: np.ndarray, history: list[list[int]], prompt_len: list[int], rep: list[float],
                     freq: list[float], pres: list[float], bias: list[dict[int, float]]) -> np.ndarray:
    """The penalties one row at a time in numpy: HF's repetition penalty, OpenAI's frequency/presence, logit_bias."""
    out = logits.copy()
    for i, hist in enumerate(history):
        for t in set(hist):
            out[i, t] = out[i, t] / rep[i] if out[i, t] > 0 else out[i, t] * rep[i]
        gen = hist[prompt_len[i]:]
        for t in set(gen):
            out[i, t] -= gen.count(t) * freq[i] + pres[i]
        for t, b in bias[i].items():
            out[i, t] += b
    return out


def test_adjust_logits_matches_the_per_row_reference():
    from jaxserve.engine.sampling import LogitAdjust, adjust_logits

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, V)).astype(np.float32) * 3
    history = [[5, 9, 9, 12, 5, 5], [1, 2, 3], []]
    prompt_len = [2, 3, 0]
    rep, freq, pres = [1.3, 0.7, 1.0], [0.5, -0.4, 0.0], [0.25, 1.0, 0.0]
    bias = [{7: 5.0, 9: -100.0}, {}, {299: 3.0}]
    L, K = 8, 2
    h = np.full((3, L), -1, np.int32)
    ids, vals = np.full((3, K), -1, np.int32), np.zeros((3, K), np.float32)
    for i in range(3):
        h[i, :len(history[i])] = history[i]
        ids[i, :len(bias[i])] = list(bias[i])
        vals[i, :len(bias[i])] = list(bias[i].values())
    a = LogitAdjust(*(jnp.asarray(x) for x in (h, np.array(prompt_len, np.int32), np.array(rep, np.float32),
                                               np.array(freq, np.float32), np.array(pres, np.float32), ids, vals)))
    got = np.asarray(jax.jit(adjust_logits)(jnp.asarray(logits), a))
    want = adjust_reference(logits, history, prompt_len, rep, freq, pres, bias)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("mode", ["greedy", "top_k", "full"])
def test_mask_restricts_every_program_to_allowed_tokens(mode):
    rows = [(0.0, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.7, 0, 1.0)]
    allowed_ids = [[3], [10, 200, 299], [0, 64, 65], list(range(100, 110))]
    W = (V + 31) // 32
    mask = np.zeros((4, W), np.uint32)
    for i, ids in enumerate(allowed_ids):
        for t in ids:
            mask[i, t // 32] |= np.uint32(1 << (t % 32))
    for trial in range(6):
        base = arrays(rows, seeds=[trial, 2, 3, 4], step=trial, mode=mode)
        s = SamplingArrays(base.temperature, base.top_k, base.top_p, base.seed, base.step,
                           mask=jnp.asarray(mask.view(np.int32)), mode=mode)
        out = jax.jit(sample)(logits_for(trial, 4, peaked=False), s)
        for i, t in enumerate(np.asarray(out.tokens).tolist()):
            assert t in allowed_ids[i], (mode, trial, i, t)


def test_top_logprobs_are_the_most_likely_tokens_of_the_model():
    logits = logits_for(3, 4, peaked=True)
    base = arrays([(0.0, 0, 1.0)] * 4, seeds=[0] * 4, step=0)
    s = SamplingArrays(base.temperature, base.top_k, base.top_p, base.seed, base.step, mode="greedy", top_n=5)
    out = jax.jit(sample)(logits, s)
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    want = np.argsort(-lp, axis=-1, kind="stable")[:, :5]
    np.testing.assert_array_equal(np.asarray(out.top_ids), want)
    np.testing.assert_allclose(np.asarray(out.top_logprobs), np.take_along_axis(lp, want, axis=-1), rtol=1e-6)
    assert np.all(np.asarray(out.top_ids)[:, 0] == np.asarray(out.tokens))  # greedy picks the most likely
