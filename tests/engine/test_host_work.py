"""Per-request host work stays off the engine loop (`engine.text_stream`, `Engine.submit`): a request's text
(detokenization, stop strings) is made on its consumer's thread, never on the loop thread "jaxserve-engine"; a stop
string found there ends the request in the engine (its pages are back when its stream ends, the tokens the engine
made meanwhile are dropped); a request whose grammar is slow to build does not hold back another stream's tokens.

Structural, not timed: the slow build is a hook that blocks until the other stream has received more tokens, so a
build run inside the engine step would deadlock it; the bounded wait would then time out and the test fail."""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from engine_util import Progress, engine_advances, pool_is_full, record_decoder_threads, small_config
from jaxserve.engine import Engine, Request, SamplingParams
from jaxserve.engine.structured import StructuredOutput

EMBEDDED = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi"
LOOP_THREAD = "jaxserve-engine"
WAIT_S = 120.0  # bounded waits: a deadlock fails the test instead of hanging it
MORE = 5  # tokens the running stream must receive while the other request's work is blocked


@pytest.fixture(scope="module")
def eng():
    # the embedded model (its tokenizer's vocabulary, grammars need it) with its loop on its own thread; no prefix
    # cache: a repeated prompt runs the same programs, so greedy repeats exactly
    e = Engine.from_checkpoint(EMBEDDED, small_config(max_model_len=128, prefix_cache=False))
    yield e
    e.close()


@pytest.fixture(scope="module")
def prompt(eng):
    return eng.encode("def add(a, b):\n    return a + b\n\n\ndef")


class Counted(Progress):
    """Consumes a stream on its own thread ("consumer-a"), counting its token events."""

    def __init__(self, stream: object) -> None:
        super().__init__(WAIT_S)
        self.events: list = []
        self.thread = threading.Thread(target=self._run, args=(stream,), name="consumer-a", daemon=True)
        self.thread.start()

    def _run(self, stream: object) -> None:
        for ev in stream:
            self.events.append(ev)
            self.add(ev.token_id is not None)


def test_text_is_made_on_the_consumer_thread(eng, prompt, monkeypatch):
    names = record_decoder_threads(monkeypatch)
    sp = SamplingParams(max_tokens=12, ignore_eos=True, stop=("\x00never",))
    out = eng.generate([prompt], sp)[0]  # consumed on this thread
    a = Counted(eng.submit(Request(prompt, sp)))  # consumed on "consumer-a"
    group = list(eng.submit_group([Request(prompt, sp, request_id=f"g-{i}") for i in range(2)]))
    a.thread.join(WAIT_S)
    assert not a.thread.is_alive() and a.events[-1].finish_reason == "length"
    assert len(out.token_ids) == 12 and sum(ev.token_id is not None for _, ev in group) == 24
    assert names and LOOP_THREAD not in names
    assert set(names) == {threading.current_thread().name, "consumer-a"}
    tok = eng.tokenizer
    if tok.byte_level:  # the streamed pieces are exactly the decoded ids
        assert out.text == tok.decode(out.token_ids)
        assert "".join(ev.text for ev in a.events) == tok.decode([ev.token_id for ev in a.events[:-1]])


def test_a_stop_string_found_by_the_consumer_ends_the_request_in_the_engine(eng, prompt):
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = list(eng.submit(Request(prompt, sp)))
    text = [ev.text for ev in ref[:-1]]
    j = next(i for i in range(8, len(text)) if text[i].strip())  # a token with visible text, mid-stream
    full = "".join(text[: j + 1])
    # the shortest tail of the text up to token j that occurs nowhere before: the stop string completes at token j
    stop = next(full[-n:] for n in range(1, len(full) + 1) if full.find(full[-n:]) == len(full) - n)
    before = eng.stats()
    events = list(eng.submit(Request(prompt, dataclasses.replace(sp, stop=(stop,)))))
    assert pool_is_full(eng)  # the stream ended with the engine's acknowledgement: its pages are back
    toks, end = events[:-1], events[-1]
    assert [ev.token_id for ev in toks] == [ev.token_id for ev in ref[: j + 1]]  # none after the stop string
    assert "".join(ev.text for ev in toks) == full[: len(full) - len(stop)]
    assert end.finish_reason == "stop" and end.error is None and end.completion_tokens == j + 1
    after = eng.stats()
    assert after["aborted"] == before["aborted"] and after["finished"] == before["finished"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] >= j + 1  # the engine's own count: maybe more
    # n > 1 (one queue for the group; a batch of two may round differently from the single run, so its tokens are not
    # compared): each member ends on its own, at its stop string or at max_tokens if none occurred
    group = list(eng.submit_group([Request(prompt, dataclasses.replace(sp, stop=(stop,)), request_id=f"s-{i}")
                                   for i in range(2)]))
    assert pool_is_full(eng)
    for i in range(2):
        mine = [ev for k, ev in group if k == i]
        n = len(mine) - 1
        assert all(ev.finish_reason is None for ev in mine[:-1]) and mine[-1].completion_tokens == n
        assert stop not in "".join(ev.text for ev in mine)
        assert mine[-1].finish_reason == "stop" or mine[-1].finish_reason == "length" and n == sp.max_tokens


def test_a_slow_grammar_build_does_not_delay_another_stream(eng, prompt, monkeypatch):
    a = Counted(eng.submit(Request(prompt, SamplingParams(max_tokens=100, ignore_eos=True))))
    assert a.wait_for(1)
    build, waited = eng.grammar.matcher, []

    def slow_build(so):  # noqa: ANN001, ANN202 - blocks until the running stream got MORE tokens
        waited.append(engine_advances(eng, MORE, WAIT_S) and a.wait_more(MORE))
        return build(so)

    monkeypatch.setattr(eng.grammar, "matcher", slow_build)
    out = eng.generate([prompt], SamplingParams(max_tokens=3, structured=StructuredOutput("json_object")))[0]
    assert waited == [True]  # the stream went on while this request's grammar was being built
    assert out.finish_reason in ("stop", "length") and out.token_ids
    a.thread.join(WAIT_S)
    assert a.events[-1].finish_reason == "length" and a.count == 100
