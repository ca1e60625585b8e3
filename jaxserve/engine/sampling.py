"""Batched token sampling inside the jitted programs: greedy, temperature, top-k, top-p, per-row seeds."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters. temperature [B] f32 (0 = greedy); top_k [B] int32 (0 = off); top_p [B] f32;
    seed [B] uint32; step [B] int32 (tokens generated so far: the key is fold_in(key(seed), step), so a seed gives
    the same tokens whatever else shares the batch)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    step: jax.Array


def sample(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] f32 -> (tokens [B] int32, logprobs [B] f32 of the chosen token under the model)."""
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
    keep = keep & (before < s.top_p[:, None])  # the top token always survives
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(s.seed, s.step)
    pick = jax.vmap(jax.random.categorical)(keys, filtered)
    sampled = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(s.temperature > 0, sampled, greedy)
    return tokens, jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
