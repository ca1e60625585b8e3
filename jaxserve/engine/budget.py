"""A per-request thinking budget (`SamplingParams.thinking_budget`): the tracker that says which token, if any, a
sequence must take next because its thinking ran out of tokens.

(N, end_ids): the output starts inside a thinking block. If the first N generated tokens do not contain end_ids
(the block's end, e.g. `</think>`'s token ids), tokens N, N + 1, ... are end_ids, forced one per step: the sampling
step allows only the forced token (a one-token mask, `batch.sampling_extras`), so it reaches the device as the next
input token like any sampled one, its logprob is the model's own, and a grammar matcher consumes it as usual. A
prefix of end_ids the model wrote just before the budget ran out is completed, not repeated. Once end_ids are in,
sampling goes on unconstrained. The state is a function of the generated tokens (append-only, kept across a
preemption), so a preempted sequence's recompute forces the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ThinkingBudget:
    """Tracks one sequence's thinking. limit: N; end: end_ids; closed: the block has ended (by the model or
    forced); at: index in `end` of the next forced token, None while nothing is forced."""

    limit: int
    end: tuple[int, ...]
    closed: bool = False
    at: int | None = None

    @staticmethod
    def of(budget: tuple[int, tuple[int, ...]] | None) -> ThinkingBudget | None:
        if budget is None:
            return None
        limit, end = budget
        return ThinkingBudget(limit, tuple(end), at=0 if limit == 0 else None)

    def forced(self) -> int | None:
        """The token the next step must produce, None if it samples freely."""
        return None if self.closed or self.at is None else self.end[self.at]

    def observe(self, generated: list[int]) -> None:
        """Update after generated[-1] was appended (sampled or forced)."""
        if self.closed:
            return
        if self.at is not None:  # that token was the forced end[at]
            self.at += 1
            if self.at == len(self.end):
                self.closed, self.at = True, None
            return
        n = len(self.end)
        if generated[-n:] == list(self.end):
            self.closed = True
        elif len(generated) >= self.limit:
            # force the rest of end_ids: whatever prefix of them the output already ends with is kept
            self.at = max(k for k in range(n) if k == 0 or generated[-k:] == list(self.end[:k]))
