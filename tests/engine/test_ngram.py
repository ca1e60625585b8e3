"""ngram_drafts: the tokens after the last n-gram's most recent earlier occurrence, longest n first; nothing
without a match; a continuation that runs into the end keeps copying (a loop stays a loop)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.engine.ngram import ngram_drafts
from jaxserve.engine.spec_chain import device_ngram
from jaxserve.errors import ConfigError


def reference(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The definition one position at a time: extend the sequence by copying from after the match."""
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        starts = [i for i in range(L - n) if tokens[i:i + n] == tokens[L - n:]]
        if starts:
            seq = list(tokens)
            for m in range(k):
                seq.append(seq[starts[-1] + n + m])
            return seq[L:]
    return []


def test_match_proposes_what_followed_the_most_recent_occurrence():
    # "7 8" occurs at 0 (then 1 2 3) and at 5 (then 4 5): the most recent wins
    tokens = [7, 8, 1, 2, 3, 7, 8, 4, 5, 6, 0, 7, 8]
    assert ngram_drafts(tokens, 2) == [4, 5]
    assert ngram_drafts(tokens, 4, n_max=2) == [4, 5, 6, 0]


def test_no_match_proposes_nothing():
    assert ngram_drafts([1, 2, 3, 4, 5], 3) == []
    assert ngram_drafts([9], 3) == [] and ngram_drafts([], 3) == []
    assert ngram_drafts([5, 1, 2, 5], 3, n_min=2) == []  # only a 1-gram recurs
    assert ngram_drafts([5, 1, 2, 5], 0) == []


def test_k_beyond_the_end_repeats_the_loop():
    # "1 2" last seen at 3, followed by 3 then the suffix: the period-3 loop continues
    assert ngram_drafts([9, 9, 9, 1, 2, 3, 1, 2], 5, n_max=2) == [3, 1, 2, 3, 1]
    assert ngram_drafts([4, 4, 4], 3) == [4, 4, 4]
    assert ngram_drafts([1, 2, 3, 1, 2, 3], 2) == [1, 2]


def test_longer_ngrams_win_over_more_recent_shorter_ones():
    tokens = [5, 2, 8, 8, 9, 2, 4, 4, 6, 5, 2]  # (5, 2) at 0 -> 8; (2) most recently at 5 -> 4
    assert ngram_drafts(tokens, 3, n_max=2) == [8, 8, 9]
    assert ngram_drafts(tokens, 3, n_max=1) == [4, 4, 6]
    assert ngram_drafts(tokens, 3, n_max=3) == [8, 8, 9]  # no 3-gram recurs: falls back to 2


def test_random_sequences_match_the_definition():
    rng = np.random.default_rng(0)
    for trial in range(300):
        tokens = rng.integers(0, 4 if trial % 2 else 12, size=rng.integers(0, 40)).tolist()
        k, n_min = int(rng.integers(0, 8)), int(rng.integers(1, 3))
        n_max = n_min + int(rng.integers(0, 3))
        assert ngram_drafts(tokens, k, n_max, n_min) == reference(tokens, k, n_max, n_min), (tokens, k, n_max, n_min)


@pytest.mark.parametrize("k", [1, 4])
def test_the_device_lookup_proposes_the_host_drafts(k):
    """spec_chain.device_ngram (chained verifies draft on the device) equals ngram_drafts row by row, padding after
    each row's length ignored."""
    rng = np.random.default_rng(k)
    rows = [rng.integers(0, 3 if i % 2 else 10, size=rng.integers(0, 30)).tolist() for i in range(48)]
    hist = rng.integers(0, 10, size=(len(rows), 32)).astype(np.int32)  # garbage past each row's tokens
    for i, r in enumerate(rows):
        hist[i, :len(r)] = r
    drafts, found = jax.jit(device_ngram, static_argnums=2)(hist, np.array([len(r) for r in rows], np.int32), k)
    got = [d.tolist() if f else [] for d, f in zip(np.asarray(drafts), np.asarray(found))]
    assert got == [ngram_drafts(r, k) for r in rows] and any(got) and not all(got)


@pytest.mark.parametrize("k,n_max,n_min", [(-1, 3, 1), (2, 1, 2), (2, 3, 0)])
def test_bad_parameters_name_themselves(k, n_max, n_min):
    with pytest.raises(ConfigError) as e:
        ngram_drafts([1, 2, 1, 2], k, n_max, n_min)
    assert e.value.value == (k, n_min, n_max)
