"""The sampling forms a prefill, decode or verify program is compiled in: two per shape, whatever the rows ask.

  * "greedy": every row is greedy and none has penalties, a logit_bias, min_tokens, a grammar, a forced token or
    top logprobs: `SamplingArrays` with mode "greedy" and no extras (one argmax; the most common batch).
  * "any" (the general form): every other batch. Mode "any" (sampling under a run-time cond on whether any row
    samples, then the top-k-or-sort choice of "full"), a `LogitAdjust` at fixed widths (history: max_model_len
    tokens; MAX_LOGIT_BIAS biases), an allowed-token bitmask [B, ceil(V / 32)] int32 ([B, k + 1, ceil(V / 32)] in a
    verify program: one per position, for grammar rows' drafts, `engine.spec_grammar`) and top alternatives
    TOP_LOGPROBS_MAX wide with a per-row `top_rows` flag, each applied under a cond on its data
    (`sampling.processed_logits`, `sampling.top_alternatives`): what a batch asks for is data, never a new program.
Rows that need no extra take neutral device arrays (no history, no bias, all tokens allowed, no top alternatives)
cached per (rows, placement), so a sampled batch without extras uploads nothing more than before; a batch with
extras uploads them in one transfer. A batch's sampled tokens are the same in either form (tests/engine/
test_sampling_forms.py); the cost of the general form against the specialised programs is measured by
bench/sampling_forms.py (bench/results/sampling_forms.json).
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import TypeVar

import jax
import numpy as np

from jaxserve.engine.request import MAX_LOGIT_BIAS
from jaxserve.engine.sampling import TOP_LOGPROBS_MAX, LogitAdjust, SamplingArrays, SamplingMode

# the sampling forms each prefill / decode / verify shape compiles (`SamplingForms.compiled`)
SERVING_MODES: tuple[SamplingMode, ...] = ("greedy", "any")
Out = TypeVar("Out")


@dataclass(frozen=True)
class _Neutral:
    """One (rows, placement)'s neutral extras on the device, and the top_rows flags (all False, all True)."""

    adjust: LogitAdjust
    mask: jax.Array
    top_off: jax.Array
    top_on: jax.Array


def plain_greedy(samp: SamplingArrays) -> bool:
    """The batch runs the greedy form: every row greedy, no extras."""
    return samp.mode == "greedy" and samp.adjust is None and samp.mask is None and not samp.top_n \
        and samp.top_rows is None


class SamplingForms:
    """Puts a batch's SamplingArrays in the form its program is compiled in (see the module docstring).
    vocab: the model's vocabulary; history: the penalty history width (EngineConfig.max_model_len: a row's
    prompt and output tokens never exceed it)."""

    def __init__(self, vocab: int, history: int) -> None:
        self.vocab, self.history = vocab, history
        self.words = (vocab + 31) // 32
        self.top_n = min(TOP_LOGPROBS_MAX, vocab)
        self._neutral: dict[tuple[int, jax.sharding.Sharding | None, int], _Neutral] = {}
        self._lock = threading.Lock()  # warm-up compiles from several threads

    def form(self, samp: SamplingArrays, where: jax.sharding.Sharding | None, positions: int = 0) -> SamplingArrays:
        """The greedy form for a plain greedy batch, the general one otherwise; extras uploaded to `where` (the
        program's batch placement; None: the default device). positions: a verify's k + 1 (its mask is one per
        position), 0 for prefill and decode."""
        return samp if plain_greedy(samp) else self.general(samp, where, positions)

    def compiled(self, samp: SamplingArrays, mode: SamplingMode, where: jax.sharding.Sharding | None,
                 positions: int = 0) -> SamplingArrays:
        """A dummy batch's SamplingArrays (all greedy padding) in form `mode` of SERVING_MODES, for warm-up."""
        return samp if mode == "greedy" else self.general(samp, where, positions)

    def general(self, samp: SamplingArrays, where: jax.sharding.Sharding | None, positions: int = 0
                ) -> SamplingArrays:
        """samp with mode "any", every extra present at its fixed width (the batch's own, padded and uploaded in
        one transfer, or the cached neutral ones) and top_rows set from its top_n. positions > 0: the mask is
        [B, positions, W] (a [B, W] one applies at every position)."""
        B = samp.temperature.shape[0]
        neutral = self._neutral_of(B, where, positions)
        own = (None if samp.adjust is None else self._padded(samp.adjust, B),
               None if samp.mask is None else _per_position(np.asarray(samp.mask, np.int32), positions))
        adjust, mask = jax.device_put(own, where) if any(x is not None for x in own) else own
        return dataclasses.replace(samp, adjust=neutral.adjust if adjust is None else adjust,
                                   mask=neutral.mask if mask is None else mask,
                                   top_rows=neutral.top_on if samp.top_n else neutral.top_off, mode="any",
                                   top_n=self.top_n)

    def _padded(self, a: LogitAdjust, B: int) -> LogitAdjust:
        """A batch's LogitAdjust (host arrays, any widths up to the fixed ones) at the fixed widths."""
        history, L = np.full((B, self.history), -1, np.int32), a.history.shape[1]
        bias_ids, bias, K = np.full((B, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((B, MAX_LOGIT_BIAS), np.float32), \
            a.bias_ids.shape[1]
        if L > self.history or K > MAX_LOGIT_BIAS:
            raise ValueError(f"LogitAdjust widths ({L}, {K}) exceed ({self.history}, {MAX_LOGIT_BIAS})")
        history[:, :L], bias_ids[:, :K], bias[:, :K] = a.history, a.bias_ids, a.bias
        return LogitAdjust(history, *(np.asarray(x) for x in (a.prompt_len, a.repetition, a.frequency,
                                                              a.presence)), bias_ids, bias)

    def _neutral_of(self, B: int, where: jax.sharding.Sharding | None, positions: int) -> _Neutral:
        key = (B, where, positions)
        with self._lock:
            if key not in self._neutral:
                adjust = LogitAdjust(np.full((B, self.history), -1, np.int32), np.zeros(B, np.int32),
                                     np.ones(B, np.float32), np.zeros(B, np.float32), np.zeros(B, np.float32),
                                     np.full((B, MAX_LOGIT_BIAS), -1, np.int32),
                                     np.zeros((B, MAX_LOGIT_BIAS), np.float32))
                mask = np.full((B, positions, self.words) if positions else (B, self.words), -1, np.int32)
                host = (adjust, mask, np.zeros(B, np.bool_), np.ones(B, np.bool_))
                self._neutral[key] = _Neutral(*jax.device_put(host, where))
            return self._neutral[key]


def _per_position(mask: np.ndarray, positions: int) -> np.ndarray:
    """A batch's bitmask ([B, W], or [B, positions, W] per verify position) as the program takes it."""
    if not positions or mask.ndim == 3:
        return mask
    return np.ascontiguousarray(np.broadcast_to(mask[:, None], (mask.shape[0], positions, mask.shape[1])))


def host_outputs(out: Out, samp: SamplingArrays) -> Out:
    """A program's Sampled / Verified (device arrays) -> numpy, with the top alternatives only when the batch asked
    for them (samp: the batch's arrays before `SamplingForms.form`; otherwise empty [..., 0] arrays, never copied)."""
    return jax.tree.map(np.asarray, without_tops(out, samp))


def without_tops(out: Out, samp: SamplingArrays) -> Out:
    """out with its top alternatives dropped (empty [..., 0] host arrays) unless samp asked for them."""
    if samp.top_n:
        return out
    shape = out.top_ids.shape[:-1] + (0,)
    return dataclasses.replace(out, top_ids=np.zeros(shape, np.int32), top_logprobs=np.zeros(shape, np.float32))
