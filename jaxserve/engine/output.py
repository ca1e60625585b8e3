"""What the engine decides for each accepted token: whether it ends the sequence, and why ("eos": an end or stop
token, "grammar": a completed grammar, "length": max_tokens or the context window), and the sampled row's
top-logprob alternatives. It advances the per-token state that picks the next step's logits (the grammar matcher,
the thinking budget).

Text is not made here: the engine streams token ids, and each request's text (incremental detokenization, stop
strings) is made on the consumer's side (`engine.text_stream`), never in the engine step.
"""
from __future__ import annotations

from jaxserve.engine.sampling import Sampled
from jaxserve.engine.sequence import Sequence


def token_end(seq: Sequence, token: int, eos: set[int], max_model_len: int) -> str | None:
    """After `token` was appended to seq.generated -> why it ends seq ("eos", "grammar", "length") or None.
    Advances the grammar matcher and the thinking budget."""
    p = seq.req.params
    if seq.budget is not None:
        seq.budget.observe(seq.generated)
    if not p.ignore_eos and token in eos or token in p.stop_token_ids:
        return "eos"
    # the grammar is complete and allows nothing more: this token's text is kept, then the request stops
    if seq.matcher is not None and seq.matcher.consume_token(token) and seq.matcher.is_stopped():
        return "grammar"
    if seq.at_length_limit(max_model_len):
        return "length"
    return None


def top_alternatives(out: Sampled, i: int, seq: Sequence) -> tuple[tuple[int, float], ...]:
    """Row i's requested top alternatives: ((token id, logprob), ...), most likely first."""
    k = seq.req.params.top_logprobs
    return tuple(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
