"""A request's serving state while the scheduler holds it (`Sequence`), and the scheduler's counters (`Stats`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.engine.budget import ThinkingBudget
from jaxserve.engine.request import Request, Status


@dataclass
class Sequence:
    """A request's serving state."""

    req: Request
    order: int  # admission order, for FCFS and for choosing whom to preempt (the youngest)
    status: Status = Status.WAITING
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prefill_pages: list[tuple[int, int]] = field(default_factory=list)
    decode_pages: list[tuple[int, int]] = field(default_factory=list)
    target: int = 0  # tokens to prefill (prompt + already generated, after a preemption)
    computed: int = 0  # tokens of `target` already in the prefill pool
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    decode_len: int = 0  # tokens in the decode pool
    preemptions: int = 0
    pending: tuple[int, float, tuple] | None = None  # first token sampled by prefill, emitted after the hand-off
    slot: int = -1  # row of DecodeRows while decoding
    matcher: object = None  # llguidance.LLMatcher of a structured-output request (engine.structured)
    rank: int = 0  # data-parallel attention rank: its pages and batch rows live on that rank's devices
    prompt_scores: list | None = None  # (logprob, top) per prompt position, until sent (engine.scoring)
    budget: ThinkingBudget | None = None  # from params.thinking_budget (engine.budget)
    kv_transfer: dict | None = None  # prefill role: the export's kv_transfer_params (engine.kv_transfer)

    def __post_init__(self) -> None:
        if self.budget is None:
            self.budget = ThinkingBudget.of(self.req.params.thinking_budget)

    @property
    def special(self) -> bool:
        """Needs more than the plain sampling programs: penalties/biases, a grammar, top logprobs, or a thinking
        budget not spent yet (whether it forces a token depends on the previous one)."""
        p = self.req.params
        return p.adjusts_logits or self.matcher is not None or p.top_logprobs > 0 or \
            self.budget is not None and not self.budget.closed

    def forced_token(self) -> int | None:
        """The token the next step must produce (a spent thinking budget's end), None if it samples freely."""
        return self.budget.forced() if self.budget is not None else None

    @property
    def tokens(self) -> list[int]:
        return self.req.prompt + self.generated

    def at_length_limit(self, max_model_len: int, pending: int = 0) -> bool:
        """The sequence ends by length (max_tokens, or the context window) once its accepted tokens plus `pending`
        tokens read but not accepted yet are in (after a token; the overlap's look-ahead with pending=1)."""
        return len(self.generated) + pending >= self.req.params.max_tokens or \
            self.decode_len + pending + 1 >= max_model_len


@dataclass
class Stats:
    """The scheduler's running counters (`Engine.stats` reports them)."""

    tag_mismatches: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    overlapped: int = 0  # decode steps dispatched before the previous one was read
    transfers: int = 0  # decode role: pulls landed, their page payload bytes, page tokens, seconds
    transfer_bytes: int = 0
    transfer_tokens: int = 0
    transfer_s: float = 0.0
    verify_rows: int = 0  # speculative: rows verified (one per row per verify step)
    draft_tokens: int = 0  # speculative: draft tokens proposed
    accepted_tokens: int = 0  # speculative: draft tokens the target accepted
