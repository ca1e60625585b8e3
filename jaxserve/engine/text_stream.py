"""A request's text, made on the consumer's side of the engine: incremental detokenization (the request's
`tokenizer.StreamDecoder`) and stop strings, applied to the token events the engine streams.

Why here and not in the engine step: detokenizing is per-request host work (a slow decoder, a long stop list or a
pathological tokenizer would delay every stream's next token if it ran in the loop). With a loop thread it runs
in the request's event iterator (`Engine.submit` / `submit_group`), on the consumer's thread: the HTTP handler or
`generate`'s caller. A synchronous engine (`start=False`) has no loop thread: the caller of `step()` is the
consumer, and the text is made as events are emitted, so a stop string ends the sequence in the step it completes.

Stop strings: the text is cut where the first stop string begins, and while a request has stop strings the last
`len(longest) - 1` characters are held back from the stream (they may be the start of one), then sent at the end.
A stop string ends the stream with finish_reason "stop", its text cut there, and completion_tokens counting only
the tokens passed on; the engine is told to end the request (`Engine` aborts it with reason "stop": its pages
return at once), and the tokens it produced meanwhile are dropped.
"""
from __future__ import annotations

import dataclasses

from jaxserve.engine.request import TokenEvent


class TextStream:
    """One request's text. decoder: a tokenizer.StreamDecoder (None without a tokenizer: events pass with text "");
    stops: the request's stop strings."""

    def __init__(self, decoder: object | None, stops: tuple[str, ...]) -> None:
        self.decoder = decoder
        self.stops = stops
        self.hold = max((len(s) - 1 for s in stops), default=0)
        self.text = ""
        self.sent = 0  # characters of `text` already streamed
        self.tokens = 0  # token events passed on
        self.stopped = False  # a stop string ended the text: the request's later token events are dropped

    def token(self, ev: TokenEvent) -> TokenEvent:
        """The engine's token event -> the same with its newly completed text; sets `stopped` when a stop string
        completes at this token (the caller ends the request)."""
        self.tokens += 1
        if self.decoder is None:
            return ev
        if ev.end != "eos":  # an end token's text is not part of the output
            start = max(len(self.text) - self.hold, 0)  # a stop string completed now begins no earlier
            self.text += self.decoder.push(ev.token_id)
            cut = _find_stop(self.text, self.stops, start)
            if cut is not None:
                self.text, self.stopped = self.text[:cut], True
            elif ev.end == "length":
                self.text += self.decoder.flush()
        final = self.stopped or ev.end is not None
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent:end], end
        return dataclasses.replace(ev, text=delta)

    def finish(self, ev: TokenEvent) -> TokenEvent:
        """The engine's finish event -> the stream's: after a stop string, "stop" with the tokens passed on."""
        if not self.stopped:
            return ev
        return dataclasses.replace(ev, finish_reason="stop", error=None, completion_tokens=self.tokens,
                                   kv_transfer=None)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index in `text` where the earliest stop string beginning at or after `start` begins, None if none does."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None
