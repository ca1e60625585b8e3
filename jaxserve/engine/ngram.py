"""Prompt-lookup drafts for speculative decoding: a host-side drafter that proposes the tokens that followed the
most recent earlier occurrence of the sequence's last n tokens (prompt + output so far). No model, no device work.

The drafts are deterministic (q one-hot at each draft: `acceptance.verify_tokens(..., draft_probs=None, ...)`), so
any token is a valid draft: the verify program needs K per row, and the caller pads a shorter (or empty) list to K
with any in-vocabulary token (e.g. repeating the last one). A padded draft is verified like a real one: accepted only
where the target would have produced it anyway, so the output stays exact and padding costs nothing but the
positions.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.errors import ConfigError


def ngram_drafts(tokens: Sequence[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """tokens: the sequence so far (prompt then output); k >= 0 drafts wanted; n_max >= n_min >= 1 -> up to k draft
    tokens (the empty list when no n-gram of length n_min..n_max recurs).

    For n from n_max down to n_min (longer contexts predict better): the last n tokens' most recent earlier
    occurrence (one that starts before the suffix itself) gives the drafts: the tokens that followed it. When the
    occurrence ends within k tokens of the end, the continuation runs into the suffix itself and keeps copying, so
    the sequence's last (length - n - start) tokens repeat: a loop keeps being predicted as a loop. O(len * n) per
    n (vectorized numpy)."""
    if k < 0 or not 1 <= n_min <= n_max:
        raise ConfigError(f"ngram drafts need k >= 0 and 1 <= n_min <= n_max, got k={k}, n_min={n_min}, "
                          f"n_max={n_max}", value=(k, n_min, n_max), param="speculative")
    seq = np.asarray(tokens, dtype=np.int64)
    L = len(seq)
    if k == 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # windows over seq[:L-1]: starts 0 .. L-1-n, every n-gram followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(seq[:L - 1], n)
        hits = np.flatnonzero((windows == seq[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1])
            return np.resize(seq[start + n:], k).tolist()  # cyclic: the copy runs on into the drafts themselves
    return []
