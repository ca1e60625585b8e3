"""Speculative decoding's acceptance rule, inside the jitted verify program: which of K drafted tokens a row keeps,
and the one token the target adds after them, so that the emitted tokens are distributed exactly as sampling the
target one token at a time would (`sampling.sample`).

Position j of a row (0 <= j <= K) is the target's prediction for the token at step + j, given the context and the
drafts d_0 .. d_{j-1}. Greedy rows (temperature 0) accept d_j while it equals the first argmax of the processed
logits there, and emit that argmax at the first mismatch (or after all K). Sampled rows use the standard rule:
accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), and at the first rejection emit a draw from
norm(max(0, p_j - q_j)); after K acceptances the bonus draw is from p_K. p_j is the distribution `sample` draws
from at that step: the same penalties, biases, grammar mask, temperature, top-k and top-p, by the same functions
(sampling.processed_logits, top_k_candidates / sorted_candidates, the same top-k-or-sort choice). q_j is the
drafter's distribution (draft_probs), or, for deterministic drafters (n-gram lookup), one-hot at d_j: the rule
is exact for any draft token then, since conditioning on the draft makes q one-hot.

Random numbers: position j of a row uses the key fold_in(key(seed), step + j), `sample`'s key for that step: its
Gumbel noise draws the emitted token (so with K = 0, or once all K drafts are accepted, the token is exactly the one
`sample` would draw at that step) and fold_in(that key, 1) gives the acceptance uniform. Each key decides at most
one emitted token (positions after the first rejection are discarded, and the next verify starts at step + count),
so the draws stay independent and a seed reproduces its tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from jaxserve.engine.sampling import (TOP_K_BOUND, LogitAdjust, SamplingArrays, adjust_logits, adjusting,
                                      first_argmax, fits_top_k, gated, masked, masking, pick_sorted, pick_top_k,
                                      row_keys, sorted_candidates, top_alternatives, top_k_candidates)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Verified:
    """What verification returns: row b emits tokens[b, :count[b]]. tokens [B, K+1] int32 (the accepted drafts,
    then the target's token; entries past count are the target's choice at positions that were not reached and
    mean nothing); count [B] int32 in 1..K+1; logprobs [B, K+1] f32 (the model's own logprob of each token, before
    adjustments, as `sample` reports them); top_ids / top_logprobs [B, K+1, top_n] (samp.top_n, 0 = empty)."""

    tokens: jax.Array
    count: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def verify_tokens(target_logits: jax.Array, drafts: jax.Array, draft_probs: jax.Array | None,
                  samp: SamplingArrays, key: jax.Array | None = None) -> Verified:
    """target_logits [B, K+1, V] f32 (position j: the target's logits for the token after the context and
    drafts[:, :j]); drafts [B, K] int32 (any value outside [0, V) is never accepted); draft_probs [B, K, V] f32,
    the drafter's distribution each draft was drawn from, or None for deterministic drafts (q one-hot); samp: the
    rows' SamplingArrays as for `sample` (step = tokens generated before position 0; adjust.history without the
    drafts, which are appended per position here; mask [B, W] for every position or [B, K+1, W] per position; the
    logit_bias applies to every position). key: None for `sample`'s per-row streams; a key here salts them
    (fold_in(fold_in(key, seed), step)). Returns Verified (see there)."""
    B, K1, V = target_logits.shape
    K = K1 - 1
    flat = _per_position(samp, drafts)
    logits = _processed(target_logits.reshape(B * K1, V), samp, drafts)
    best = first_argmax(logits).reshape(B, K1)
    accept, final = drafts == best[:, :K], best

    def rule() -> tuple[jax.Array, jax.Array]:
        s_accept, s_final = _sampled(logits, flat, drafts, draft_probs, key)
        sampled = (samp.temperature > 0)[:, None]
        return jnp.where(sampled, s_accept, accept), jnp.where(sampled, s_final, final)

    if samp.mode == "any":  # the sampled rule only when some row samples
        accept, final = jax.lax.cond(jnp.any(samp.temperature > 0), rule, lambda: (accept, final))
    elif samp.mode != "greedy":
        accept, final = rule()
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # the accepted draft prefix
    emitted = jnp.concatenate([drafts.astype(jnp.int32), final[:, K:]], axis=1)
    tokens = jnp.where(jnp.arange(K1)[None, :] < n[:, None], emitted, final).astype(jnp.int32)
    logprobs_all = jax.nn.log_softmax(target_logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs_all, tokens[..., None], axis=-1)[..., 0]
    top_lp, top_ids = top_alternatives(logprobs_all, samp)
    return Verified(tokens, n + 1, chosen, top_ids, top_lp)


def _per_position(s: SamplingArrays, drafts: jax.Array) -> SamplingArrays:
    """[B]-row SamplingArrays -> [B * (K+1)] rows, row b * (K+1) + j for position j: step + j (penalties and
    masks are left to `_processed`)."""
    K1 = drafts.shape[1] + 1

    def rep(x: jax.Array) -> jax.Array:
        return jnp.repeat(x, K1, axis=0)

    step = (s.step[:, None] + jnp.arange(K1, dtype=s.step.dtype)[None, :]).reshape(-1)
    return replace(s, temperature=rep(s.temperature), top_k=rep(s.top_k), top_p=rep(s.top_p), seed=rep(s.seed),
                   step=step, adjust=None, mask=None, top_rows=None, top_n=0)


def _processed(raw: jax.Array, s: SamplingArrays, drafts: jax.Array) -> jax.Array:
    """raw [B * (K+1), V] f32 (position j of row b at b * (K+1) + j) -> the logits after row b's penalties and
    biases (position j's history: the drafts before j appended) and position j's mask, each under a cond on its
    [B]-row data (`sampling.processed_logits`), so a batch without them pays for no per-position copy."""
    B, K1 = drafts.shape[0], drafts.shape[1] + 1
    if s.adjust is not None:
        raw = gated(adjusting(s.adjust), lambda x: adjust_logits(x, _with_drafts(s.adjust, drafts)), raw)
    if s.mask is not None:
        mask = s.mask

        def per_position(x: jax.Array) -> jax.Array:
            flat = mask.reshape(B * K1, mask.shape[-1]) if mask.ndim == 3 else jnp.repeat(mask, K1, axis=0)
            return masked(x, flat)

        raw = gated(masking(mask), per_position, raw)
    return raw


def _with_drafts(a: LogitAdjust, drafts: jax.Array) -> LogitAdjust:
    """Position j's penalties see drafts[:, :j] as generated tokens: appended after the history (-1 elsewhere)."""
    B, K = drafts.shape
    K1, L = K + 1, a.history.shape[1]
    before = jnp.arange(K)[None, :] < jnp.arange(K1)[:, None]  # [K+1, K]: draft i precedes position j
    seen = jnp.where(before[None], drafts[:, None, :], -1).astype(a.history.dtype)
    history = jnp.concatenate([jnp.broadcast_to(a.history[:, None, :], (B, K1, L)), seen], axis=-1)
    rep = lambda x: jnp.repeat(x, K1, axis=0)  # noqa: E731
    return LogitAdjust(history.reshape(B * K1, L + K), rep(a.prompt_len), rep(a.repetition), rep(a.frequency),
                       rep(a.presence), rep(a.bias_ids), rep(a.bias))


def _sampled(logits: jax.Array, flat: SamplingArrays, drafts: jax.Array, draft_probs: jax.Array | None,
             key: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """The rule for sampled rows: logits [B*(K+1), V] processed -> (accept [B, K] bool, token [B, K+1] int32: the
    residual draw at positions < K, the bonus draw at K). Top-k candidates when every row's fit, as `sample`."""
    B, K = drafts.shape
    K1, (N, V) = K + 1, logits.shape
    scaled = logits / jnp.maximum(flat.temperature, 1e-6)[:, None]
    if key is None:
        keys = row_keys(flat.seed, flat.step)
    else:
        keys = jax.vmap(lambda sd, st: jax.random.fold_in(jax.random.fold_in(key, sd), st))(flat.seed, flat.step)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)
    d = jnp.concatenate([drafts.astype(jnp.int32), jnp.full((B, 1), -1, jnp.int32)], axis=1).reshape(N)
    q = None
    if draft_probs is not None:
        q = jnp.concatenate([draft_probs, jnp.zeros((B, 1, V), draft_probs.dtype)], axis=1).reshape(N, V)
    last = jnp.tile(jnp.arange(K1) == K, B)
    c = min(TOP_K_BOUND, V)

    def top() -> tuple[jax.Array, jax.Array]:
        return _rule(*top_k_candidates(scaled, flat, c), pick_top_k, d, q, u, keys, last)

    def full() -> tuple[jax.Array, jax.Array]:
        return _rule(*sorted_candidates(scaled, flat), pick_sorted, d, q, u, keys, last)

    if flat.mode == "top_k":
        accept, token = top()
    else:
        accept, token = jax.lax.cond(jnp.all(fits_top_k(scaled, flat, c)), top, full)
    return accept.reshape(B, K1)[:, :K], token.reshape(B, K1)


def _rule(ids: jax.Array, filtered: jax.Array, pick: Callable[[jax.Array, jax.Array], jax.Array], d: jax.Array,
          q: jax.Array | None, u: jax.Array, keys: jax.Array, last: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One position per row over C candidates: ids [N, C] int32, filtered [N, C] f32 (p = softmax), pick (the
    candidates' sampler), d [N] draft (-1: none), q [N, V] or None (one-hot at d), u [N] uniforms, last [N] (the
    bonus position) -> (accept [N] bool: u * q(d) < p(d), token [N] int32: the residual or bonus draw)."""
    V = None if q is None else q.shape[-1]
    p = jax.nn.softmax(filtered, axis=-1)
    hit = ids == d[:, None]
    p_d = jnp.sum(jnp.where(hit, p, 0.0), axis=-1)
    if q is None:
        q_c, q_d = hit.astype(p.dtype), jnp.ones_like(p_d)
    else:
        q_c = jnp.take_along_axis(q, ids, axis=-1)
        q_d = jnp.take_along_axis(q, jnp.clip(d, 0, V - 1)[:, None], axis=-1)[:, 0]
    accept = (d >= 0) & (u * q_d < p_d)
    resid = jnp.maximum(p - q_c, 0.0)
    x = jnp.where(resid > 0, jnp.log(jnp.where(resid > 0, resid, 1.0)), -jnp.inf)
    # the bonus draws from p itself (filtered: `sample`'s very draw); an empty residual only arises when p == q
    # on the candidates, where rejection has probability 0
    plain = last | jnp.all(resid <= 0, axis=-1)
    x = jnp.where(plain[:, None], filtered, x)
    token = jnp.take_along_axis(ids, pick(keys, x)[:, None], axis=-1)[:, 0]
    return accept, token.astype(jnp.int32)
