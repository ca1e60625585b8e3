"""Prompt logprobs (`SamplingParams.prompt_logprobs`) out of the prefill program: the device side (`prompt_scores`:
log-softmax of every chunk position's logits gathered at the next prompt token, with top-k), the host side
(`score_targets`: the next-token array a prefill batch uploads; `take_scores`: a row's results into its sequence;
`prompt_result`: the finished `PromptLogprobs`, handed out once).

Only a batch whose rows all ask runs the scoring prefill (the scheduler never mixes them), so requests without
prompt logprobs keep the program that runs the last layer's tail and the head at each row's last token only.
The scoring prefill has one program per shape (so the warm-up can hold its grid, `warmup.plan_keys`): always the
general sampling form (`SCORING_MODE`) and `TOP_LOGPROBS_MAX` alternatives, sliced to what each row asked for.
A scoring request bypasses the prefix cache (the skipped positions would have no logits); it still fills it.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.request import PromptLogprobs
from jaxserve.engine.sampling import TOP_LOGPROBS_MAX, SamplingMode
from jaxserve.engine.sequence import Sequence

SCORING_MODE: SamplingMode = "any"  # the sampling form of every scoring prefill (`SamplingForms.general`)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PromptScores:
    """logprobs [B, T] f32: at chunk position j, log p(next token | tokens up to j) (0 where no target);
    top_ids [B, T, K] int32 / top_logprobs [B, T, K] f32: the K most likely next tokens (K 0 or
    TOP_LOGPROBS_MAX)."""

    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def prompt_scores(logits: jax.Array, targets: jax.Array, top: int) -> PromptScores:
    """logits [B, T, V] f32 (every chunk position), targets [B, T] int32 (the token after each position, -1 for
    none) -> PromptScores with top (static) alternatives per position."""
    lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(lsm, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    lp = jnp.where(targets >= 0, lp, 0.0)
    if top:
        top_lp, top_ids = jax.lax.top_k(lsm, top)
    else:
        B, T = targets.shape
        top_lp, top_ids = jnp.zeros((B, T, 0), jnp.float32), jnp.zeros((B, T, 0), jnp.int32)
    return PromptScores(lp, top_ids.astype(jnp.int32), top_lp)


def wants_scores(seq: Sequence) -> bool:
    """The sequence's prefill must return prompt logprobs (not after a preemption: they went out with its first
    token)."""
    return seq.req.params.prompt_logprobs is not None and not seq.generated


def score_targets(rows: list[tuple[Sequence, int, int]], place: list[int], b: int, t: int
                  ) -> tuple[np.ndarray | None, int]:
    """A prefill batch's scoring inputs: (targets [b, t] int32: prompt token start + j + 1 of each row's chunk,
    -1 past the prompt or for padding; None when no row asks), and the static top-k width (TOP_LOGPROBS_MAX: one
    program whatever the rows ask; `take_scores` keeps each row's own)."""
    if not rows or not wants_scores(rows[0][0]):
        return None, 0
    targets = np.full((b, t), -1, np.int32)
    for i, (seq, start, n) in zip(place, rows):
        prompt = seq.req.prompt
        end = min(start + n + 1, len(prompt))
        targets[i, : max(end - start - 1, 0)] = prompt[start + 1: end]
    return targets, TOP_LOGPROBS_MAX


def take_scores(seq: Sequence, scores: PromptScores, i: int, start: int, n: int) -> None:
    """Row i's chunk [start, start + n) of scores (numpy) into seq.prompt_scores: (logprob, top) per prompt
    position, position 0 none."""
    prompt, k = seq.req.prompt, seq.req.params.prompt_logprobs or 0
    if seq.prompt_scores is None:
        seq.prompt_scores = [(None, ())] + [(0.0, ())] * (len(prompt) - 1)
    for j in range(n):
        pos = start + j + 1
        if pos < len(prompt):
            top = tuple(zip(scores.top_ids[i, j, :k].tolist(), scores.top_logprobs[i, j, :k].tolist()))
            seq.prompt_scores[pos] = (float(scores.logprobs[i, j]), top)


def prompt_result(seq: Sequence) -> PromptLogprobs | None:
    """The sequence's prompt logprobs, once (None afterwards, and for a request that asked for none)."""
    if seq.prompt_scores is None:
        return None
    scores, seq.prompt_scores = seq.prompt_scores, None
    return PromptLogprobs(tuple(lp for lp, _ in scores), tuple(top for _, top in scores))
