"""Batched token sampling inside the jitted programs: greedy, temperature, top-k, top-p, per-row seeds.

Three programs, chosen by the host per batch (`SamplingArrays.mode`, static, so each is its own compile):
  * "greedy": every row has temperature 0: one argmax, no sort, no random numbers.
  * "top_k": every sampled row has 1 <= top_k <= TOP_K_BOUND: `lax.top_k(TOP_K_BOUND)` instead of sorting the
    vocabulary.
  * "full": anything else. At run time, if every row's candidates lie within the top TOP_K_BOUND (a top_k within
    the bound, or a top-p nucleus whose mass the top TOP_K_BOUND reach with margin) the top-k branch runs;
    otherwise the whole vocabulary is sorted (`lax.cond`: only one branch executes).

Every path draws the same token as sorting the whole vocabulary would: the Gumbel noise is indexed by rank, and
with partitionable threefry (JAX's default) the first K noise values of a V-long draw equal a K-long draw, so
the top-k path needs only K of them. Rounding can differ in the last ulp of a probability (a shorter sum), which
only matters where a cumulative probability equals top_p to float precision.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import jax
import jax.numpy as jnp

# Candidates the top-k path keeps per row: requests with top_k in [1, 64] (or a nucleus within the top 64) never
# sort the vocabulary; 64 costs one lax.top_k over the vocabulary and 64 random draws per row.
TOP_K_BOUND = 64
# A top-p-only row takes the top-k path when the top TOP_K_BOUND tokens hold at least top_p + this much mass: the
# margin covers the rounding difference between the two paths' probability sums.
NUCLEUS_MARGIN = 1e-4

SamplingMode = Literal["greedy", "top_k", "full"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters. temperature [B] f32 (0 = greedy); top_k [B] int32 (0 = off); top_p [B] f32;
    seed [B] uint32; step [B] int32 (tokens generated so far: the key is fold_in(key(seed), step), so a seed gives
    the same tokens whatever else shares the batch). mode (static): which sampling program runs, see the module
    docstring; `sampling_mode` picks it from the rows' parameters."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    step: jax.Array
    mode: SamplingMode = field(default="full", metadata=dict(static=True))


def sampling_mode(rows: Iterable[tuple[float, int, float]]) -> SamplingMode:
    """Host side: the cheapest program that samples every row exactly. rows: (temperature, top_k, top_p) each."""
    sampled = [(k, p) for t, k, p in rows if t > 0]
    if not sampled:
        return "greedy"
    if all(1 <= k <= TOP_K_BOUND for k, _ in sampled):
        return "top_k"
    return "full"


def sample(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] f32 -> (tokens [B] int32, logprobs [B] f32 of the chosen token under the model)."""
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if s.mode != "greedy":
        scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
        keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(s.seed, s.step)
        k = min(TOP_K_BOUND, logits.shape[-1])
        if s.mode == "top_k":
            sampled = _sample_top_k(scaled, s, keys, k)
        else:
            sampled = jax.lax.cond(jnp.all(_fits_top_k(scaled, s, k)), lambda: _sample_top_k(scaled, s, keys, k),
                                   lambda: _sample_sorted(scaled, s, keys))
        tokens = jnp.where(s.temperature > 0, sampled, tokens)
    return tokens, jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]


def _fits_top_k(scaled: jax.Array, s: SamplingArrays, k: int) -> jax.Array:
    """[B] bool: the row's candidates lie within its top k (greedy rows trivially do)."""
    vals, _ = jax.lax.top_k(scaled, k)
    m = jnp.max(vals, axis=-1, keepdims=True)  # (see _sample_top_k)
    mass = jnp.sum(jnp.exp(vals - m), axis=-1) / jnp.sum(jnp.exp(scaled - m), axis=-1)
    nucleus_fits = (s.top_k == 0) & (mass >= s.top_p + NUCLEUS_MARGIN)
    return (s.temperature <= 0) | ((s.top_k >= 1) & (s.top_k <= k)) | nucleus_fits


def _sample_top_k(scaled: jax.Array, s: SamplingArrays, keys: jax.Array, k: int) -> jax.Array:
    """scaled [B, V] -> [B] int32, over the top k candidates only (valid for rows `_fits_top_k` accepts)."""
    vals, idx = jax.lax.top_k(scaled, k)  # [B, k], ties: lower index first, as the stable sort orders them
    rank = jnp.arange(k)[None, :]
    has_k = s.top_k[:, None] > 0
    keep = jnp.where(has_k, rank < s.top_k[:, None], True)
    masked = jnp.where(keep, vals, -jnp.inf)
    # the max, not vals[:, :1]: a second slice of top_k's sort defeats XLA's rewrite of it into a TopK call
    top = jnp.max(vals, axis=-1, keepdims=True)
    # a top-k row normalizes over its kept candidates; a top-p-only row over the whole vocabulary, as the sort does
    denom = jnp.where(has_k, jnp.sum(jnp.exp(masked - top), axis=-1, keepdims=True),
                      jnp.sum(jnp.exp(scaled - top), axis=-1, keepdims=True))
    probs = jnp.exp(masked - top) / denom
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (before < s.top_p[:, None])  # the top token always survives
    filtered = jnp.where(keep, vals, -jnp.inf)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, (k,), scaled.dtype))(keys)  # = ranks [0, k) of a V draw
    pick = jnp.argmax(filtered + noise, axis=-1)
    return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _sample_sorted(scaled: jax.Array, s: SamplingArrays, keys: jax.Array) -> jax.Array:
    """scaled [B, V] -> [B] int32 by sorting the whole vocabulary (any top_k / top_p)."""
    V = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = jnp.where(s.top_k[:, None] > 0, rank < s.top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & (before < s.top_p[:, None])  # the top token always survives
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)
    pick = jax.vmap(jax.random.categorical)(keys, filtered)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
