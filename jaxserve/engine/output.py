"""What a sequence streams for each accepted token: its newly completed text (incremental detokenization through
the request's `tokenizer.StreamDecoder`), whether the token ends it (an end or stop token, a completed grammar, a
stop string, the length limit), and the sampled row's top-logprob alternatives.

Stop strings: the text is cut where the first stop string begins, and while a request has stop strings the last
`len(longest) - 1` characters are held back from the stream (they may be the start of one), then sent at the end.
"""
from __future__ import annotations

from jaxserve.engine.sampling import Sampled
from jaxserve.engine.sequence import Sequence


def token_output(seq: Sequence, token: int, eos: set[int], max_model_len: int) -> tuple[str, str | None]:
    """After `token` was appended to seq.generated -> (text to stream now, finish reason: "stop", "length" or
    None). Advances seq.text / seq.text_sent, the grammar matcher and the thinking budget."""
    p = seq.req.params
    if seq.budget is not None:
        seq.budget.observe(seq.generated)
    reason = None
    if not p.ignore_eos and token in eos or token in p.stop_token_ids:
        reason = "stop"
    # the grammar is complete and allows nothing more: this token's text is kept, then the request stops
    done = seq.matcher is not None and reason is None and seq.matcher.consume_token(token) \
        and seq.matcher.is_stopped()
    delta = ""
    if seq.decoder is not None and reason is None:
        if _push_text(seq, token) or done:
            reason = "stop"
        hold = 0 if reason else max((len(s) - 1 for s in p.stop), default=0)
        delta = _take_text(seq, hold)
    if done:
        reason = "stop"
    if reason is None and seq.at_length_limit(max_model_len):
        reason = "length"
    if reason is not None and seq.decoder is not None:
        if reason != "stop":
            seq.text += seq.decoder.flush()
        delta += seq.text[seq.text_sent:]
        seq.text_sent = len(seq.text)
    return delta, reason


def _push_text(seq: Sequence, token: int) -> bool:
    """Append token's text to seq.text, cut where a stop string begins -> whether a stop string was found."""
    seq.text += seq.decoder.push(token)
    cut = _find_stop(seq.text, seq.req.params.stop)
    if cut is None:
        return False
    seq.text = seq.text[:cut]
    return True


def _take_text(seq: Sequence, hold: int) -> str:
    """The text not streamed yet, less its last `hold` characters; marks it streamed."""
    end = max(seq.text_sent, len(seq.text) - hold)
    delta, seq.text_sent = seq.text[seq.text_sent:end], end
    return delta


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in `text` where the earliest stop string begins, None if none occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def top_alternatives(out: Sampled, i: int, seq: Sequence) -> tuple[tuple[int, float], ...]:
    """Row i's requested top alternatives: ((token id, logprob), ...), most likely first."""
    k = seq.req.params.top_logprobs
    return tuple(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))
