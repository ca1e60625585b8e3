"""verify_tokens: greedy rows keep the longest draft prefix that matches the target's argmax (computed here from the
logits), sampled rows emit exactly the target's distribution (chi-square over 20,000 seeded runs per case), and
with no drafts it draws `sample`'s very tokens."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.acceptance import Verified, verify_tokens
from jaxserve.engine.sampling import LogitAdjust, SamplingArrays, sample, sampling_mode

VERIFY = jax.jit(verify_tokens)
SAMPLE = jax.jit(sample)


def arrays(rows: list[tuple[float, int, float]], seeds: np.ndarray | list[int], step: np.ndarray | int,
           mode: str | None = None, **extra) -> SamplingArrays:
    """SamplingArrays for rows of (temperature, top_k, top_p); extra: adjust / mask / top_n."""
    t, k, p = (np.array(c) for c in zip(*rows))
    return SamplingArrays(jnp.asarray(t, jnp.float32), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32),
                          jnp.asarray(seeds, jnp.uint32), jnp.broadcast_to(jnp.asarray(step, jnp.int32), (len(rows),)),
                          mode=mode or sampling_mode(rows), **extra)


def longest_prefix(best: np.ndarray, drafts: np.ndarray) -> tuple[list[int], int]:
    """The greedy rule one row at a time: drafts while they equal the argmax, then the argmax."""
    out = []
    for j, d in enumerate(drafts):
        if d != best[j]:
            break
        out.append(int(d))
    out.append(int(best[len(out)]))
    return out, len(out)


def check_greedy(got: Verified, logits: np.ndarray, processed: np.ndarray, drafts: np.ndarray) -> list[int]:
    """Asserts got equals the longest-prefix rule on processed's argmax; returns the counts."""
    best = processed.argmax(-1)
    logprobs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    counts = []
    for b in range(drafts.shape[0]):
        want, n = longest_prefix(best[b], drafts[b])
        assert int(got.count[b]) == n, b
        np.testing.assert_array_equal(np.asarray(got.tokens[b, :n]), want)
        np.testing.assert_allclose(np.asarray(got.logprobs[b, :n]), logprobs[b, np.arange(n), want], rtol=1e-6)
        counts.append(n)
    return counts


def greedy_case(seed: int, B: int, K: int, V: int) -> tuple[np.ndarray, np.ndarray]:
    """Random logits and drafts that follow the argmax for a row-dependent number of positions, then leave it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, K + 1, V)).astype(np.float32) * 3
    best = logits.argmax(-1)
    drafts = rng.integers(0, V, size=(B, K)).astype(np.int32)
    for b in range(B):
        m = b % (K + 1)  # rows cover every accepted length 0..K
        drafts[b, :m] = best[b, :m]
        if m < K:
            drafts[b, m] = (best[b, m] + 1) % V
    return logits, drafts


@pytest.mark.parametrize("mode", ["greedy", "full"])
def test_greedy_rows_keep_the_longest_matching_prefix(mode):
    B, K, V = 12, 4, 50
    logits, drafts = greedy_case(0, B, K, V)
    s = arrays([(0.0, 0, 1.0)] * B, np.arange(B), 5, mode=mode)
    got = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), None, s)
    assert got.tokens.shape == (B, K + 1) and got.tokens.dtype == jnp.int32 and got.count.dtype == jnp.int32
    counts = check_greedy(got, logits, logits, drafts)
    assert sorted(set(counts)) == list(range(1, K + 2))  # every outcome occurs
    # draft_probs do not matter to greedy rows
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(1), (B, K, V)), axis=-1)
    again = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), probs, s)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(got.tokens))
    np.testing.assert_array_equal(np.asarray(again.count), np.asarray(got.count))


def test_greedy_follows_the_processed_logits():
    """Presence penalty over the history plus the drafts before each position, and a grammar mask per position."""
    B, K, V = 6, 3, 40
    logits, drafts = greedy_case(1, B, K, V)
    drafts[:, 0] = logits[:, 0].argmax(-1)  # position 1's penalty sees draft 0
    presence = 4.0
    history = np.full((B, 3), -1, np.int32)
    history[:, 0] = 7  # prompt token: no presence penalty
    history[:, 1] = logits[:, 1].argmax(-1)  # a generated token: penalized at every position
    adjust = LogitAdjust(jnp.asarray(history), jnp.ones(B, jnp.int32), jnp.ones(B, jnp.float32),
                         jnp.zeros(B, jnp.float32), jnp.full(B, presence, jnp.float32),
                         jnp.full((B, 1), -1, jnp.int32), jnp.zeros((B, 1), jnp.float32))
    allowed = np.ones((B, K + 1, V), bool)
    allowed[:, 2, logits[:, 2].argmax(-1)] = False  # position 2 bans its raw argmax
    mask = np.packbits(np.pad(allowed, ((0, 0), (0, 0), (0, 64 - V))), axis=-1, bitorder="little")
    mask = mask.reshape(B, K + 1, -1).view(np.int32)
    s = arrays([(0.0, 0, 1.0)] * B, np.arange(B), 0, adjust=adjust, mask=jnp.asarray(mask))
    got = VERIFY(jnp.asarray(logits), jnp.asarray(drafts), None, s)
    processed = logits.copy()
    for b in range(B):
        for j in range(K + 1):
            generated = set(history[b, 1:2].tolist()) | set(drafts[b, :j].tolist())
            processed[b, j, list(generated)] -= presence
    processed[~allowed] = -np.inf
    assert (processed.argmax(-1) != logits.argmax(-1)).any()  # the adjustments matter
    check_greedy(got, logits, processed, drafts)


def test_no_drafts_is_sample():
    """K = 0: the bonus token is `sample`'s draw for the same seed and step, in every sampling program."""
    V = 300  # > TOP_K_BOUND: the top-k path really drops candidates
    rows = [(0.0, 0, 1.0), (1.0, 50, 1.0), (0.7, 5, 0.9), (1.0, 0, 0.9), (0.8, 0, 1.0), (1.3, 64, 0.5)]
    for trial in range(6):
        x = jax.random.normal(jax.random.key(trial), (len(rows), V)) * (6.0 if trial % 2 else 1.0)
        for mode in {sampling_mode(rows), "full"} | ({"top_k"} if trial < 3 else set()):
            r = rows if mode != "top_k" else [(t, k if k else 64, p) for t, k, p in rows]
            s = arrays(r, [trial, 1, 2, 3, 4, 5], trial, mode=mode, top_n=3)
            want = SAMPLE(x, s)
            got = VERIFY(x[:, None, :], jnp.zeros((len(rows), 0), jnp.int32), None, s)
            np.testing.assert_array_equal(np.asarray(got.count), 1)
            np.testing.assert_array_equal(np.asarray(got.tokens[:, 0]), np.asarray(want.tokens))
            np.testing.assert_array_equal(np.asarray(got.logprobs[:, 0]), np.asarray(want.logprobs))
            np.testing.assert_array_equal(np.asarray(got.top_ids[:, 0]), np.asarray(want.top_ids))
