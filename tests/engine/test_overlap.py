"""Overlapped decode (`EngineConfig.overlap`): step N+1 is dispatched before step N's tokens are read. The same
engine run one step at a time is the reference: same tokens, logprobs, texts and finish reasons for a mixed
workload, every KV page back, only accepted tokens counted; a fault fails only its request; and the dispatch order
itself is checked by recording the Programs entry points the scheduler calls.

Every program runs at one shape (`batch_invariant_buckets`): with overlap a row that stops on a token at step N
also rides in N+1 (its result is dropped), which may change N+1's row bucket, and a different shape may move the
last bits of the logits (see engine.sampling's "Seeds and batches"); pinned shapes make the comparison exact."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine_util import pool_is_full, prompts, small_config, tiny_model
from jaxserve.engine import Engine, Request, SamplingParams
from jaxserve.engine.sampling import batch_invariant_buckets
from jaxserve.errors import KVIntegrityError
from jaxserve.tokenizer import Tokenizer
from test_integrity import stale, stray_write

TOKENIZER = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi-tokenizer"
BASE = dict(num_decode_pages=128, num_prefill_pages=128, max_batch=8, max_prefill_tokens=32, prefill_chunk=16,
            max_model_len=64)


def pinned_engine() -> Engine:
    cfg = small_config(**BASE)
    return Engine(tiny_model(), dataclasses.replace(cfg, **batch_invariant_buckets(cfg)), Tokenizer(TOKENIZER),
                  start=False)


@pytest.fixture(scope="module")
def eng():
    return pinned_engine()


def set_overlap(e: Engine, on: bool) -> None:
    """Switch overlap on one engine (only the scheduler reads the flag), so both modes share compiled programs."""
    e.scheduler.cfg = dataclasses.replace(e.scheduler.cfg, overlap=on)


class Recorder:
    """Logs the scheduler's calls into Programs: ("dispatch", k) and ("read", k), k = the decode's dispatch index.
    The real methods run; nothing about the model is replaced."""

    def __init__(self, e: Engine) -> None:
        self.events: list[tuple[str, int]] = []
        self._pending: list[object] = []  # kept alive: identity, not id(), names a dispatch
        p = e.programs
        real_dispatch, real_read = p.dispatch_decode, p.read_decode

        def dispatch(batch, samp):  # noqa: ANN001, ANN202
            pending = real_dispatch(batch, samp)
            self.events.append(("dispatch", len(self._pending)))
            self._pending.append(pending)
            return pending

        def read(pending):  # noqa: ANN001, ANN202
            self.events.append(("read", next(k for k, x in enumerate(self._pending) if x is pending)))
            return real_read(pending)

        p.dispatch_decode, p.read_decode = dispatch, read

    def read_after_next_dispatch(self) -> int:
        """How many decodes were read only after the next one was dispatched."""
        order = {ev: i for i, ev in enumerate(self.events)}
        return sum(1 for kind, k in self.events if kind == "read" and order.get(("dispatch", k + 1), 1e9)
                   < order[("read", k)])


def run(e: Engine, reqs: list[Request], late: list[Request] = (), join_at: int = 3, abort: dict | None = None
        ) -> dict[str, tuple[list[int], list[float], str, str, object]]:
    """Submit reqs, step the synchronous engine; `late` joins after `join_at` steps (mid-decode); abort = {request
    id: after how many of its tokens}. -> {request id: (token ids, logprobs, text, finish reason, error)}."""
    streams = {r.request_id: e.submit(r) for r in reqs}
    got: dict[str, list] = {}
    i = 0
    while e.scheduler.has_work() or i <= join_at:
        if i == join_at:
            streams.update({r.request_id: e.submit(r) for r in late})
        e.step()
        i += 1
        for rid, n in (abort or {}).items():
            seq = next((s for s in e.scheduler.running if s.req.request_id == rid), None)
            if seq is not None and len(seq.generated) >= n:
                e.abort(rid)
    for rid, stream in streams.items():
        evs = list(stream)
        toks = [ev for ev in evs if ev.token_id is not None]
        got[rid] = ([ev.token_id for ev in toks], [ev.logprob for ev in toks], "".join(ev.text for ev in evs),
                    evs[-1].finish_reason, evs[-1].error)
    return got


def workload(tag: str, mixed: bool, stop_token: int | None = None, stop_text: str | None = None
             ) -> tuple[list, list]:
    """Requests of prompt lengths 3..30 and max_tokens 1..20 (fixed ids: the default seed derives from the id), one
    with a stop token, one with a stop string; the last joins mid-decode. Greedy, or `mixed`: also seeded top-k,
    top-p with the id's seed, and a penalty (host-side per-token state: one step at a time while it runs)."""
    ps = prompts(8, seed=31, lengths=(5, 17, 9, 30, 3, 12, 7, 11))
    sp = SamplingParams
    t = (lambda **kw: kw) if mixed else (lambda **kw: {})  # noqa: E731 - sampling fields only in the mixed run
    params = [sp(max_tokens=9, ignore_eos=True),
              sp(max_tokens=20, ignore_eos=True, stop_token_ids=(stop_token,) if stop_token is not None else ()),
              sp(max_tokens=12, ignore_eos=True, **t(temperature=1.0, top_k=50, seed=11)),
              sp(max_tokens=15, ignore_eos=True, **t(temperature=0.8, top_p=0.9)),
              sp(max_tokens=1, ignore_eos=True),
              sp(max_tokens=18, ignore_eos=True, stop=(stop_text,) if stop_text else ()),
              sp(max_tokens=4, ignore_eos=True, **t(presence_penalty=0.5)),
              sp(max_tokens=10, ignore_eos=True, **t(temperature=1.2, top_k=8))]
    reqs = [Request(list(p), q, request_id=f"{tag}-{i}") for i, (p, q) in enumerate(zip(ps, params))]
    return reqs[:7], reqs[7:]


def clean_pools(e: Engine) -> bool:
    if e.scheduler.prefix_cache is not None:
        e.scheduler.prefix_cache.clear()
    return pool_is_full(e) and e.stats()["prefill_pages_used"] == 0


def check_same_results(e: Engine, mixed: bool) -> None:
    """The workload one step at a time, then overlapped: equal results, pages back, the same accepted-token
    count; with overlap every decode but the special-row ones is read only after the next was dispatched."""
    set_overlap(e, False)
    probe = run(e, *workload("w", mixed))  # the plain run picks a stop token and a stop string from real outputs
    stop_token = probe["w-1"][0][6]
    text = probe["w-5"][2]
    assert len(text) >= 6, text
    stop_text = text[len(text) // 2: len(text) // 2 + 2]
    results, stats = {}, {}
    for on in (False, True):
        set_overlap(e, on)
        clean_pools(e)
        rec = Recorder(e)
        before = dataclasses.replace(e.scheduler.stats)
        try:
            results[on] = run(e, *workload("w", mixed, stop_token, stop_text))
        finally:
            del e.programs.dispatch_decode, e.programs.read_decode
        after = e.scheduler.stats
        stats[on] = (after.generated_tokens - before.generated_tokens, after.overlapped - before.overlapped,
                     rec.read_after_next_dispatch(), after.finished - before.finished)
        assert clean_pools(e), on  # every KV page returned
    off, on = results[False], results[True]
    assert off == on  # token ids, logprobs, text, finish reason, error of every request
    # the workload ends the way it was built to: a stop token mid-way, a stop string, lengths
    assert off["w-1"][3] == "stop" and len(off["w-1"][0]) <= 7 and off["w-1"][0][-1] == stop_token
    assert off["w-5"][3] == "stop" and stop_text not in off["w-5"][2] and len(off["w-5"][0]) < 18
    assert [len(off[f"w-{i}"][0]) for i in (0, 2, 3, 4, 6, 7)] == [9, 12, 15, 1, 4, 10]
    generated = sum(len(v[0]) for v in off.values())
    assert stats[False] == (generated, 0, 0, 8)
    assert stats[True][0] == generated and stats[True][3] == 8  # only accepted tokens are counted
    assert stats[True][1] > 5 and stats[True][2] == stats[True][1]  # decode N read after N+1 was dispatched


def test_overlap_gives_the_same_results_and_dispatches_ahead(eng):
    check_same_results(eng, mixed=False)


@pytest.mark.slow  # its own engine compiles the sampling and penalty programs (minutes on the shared host)
def test_overlap_gives_the_same_results_with_seeded_sampling_and_penalties():
    check_same_results(pinned_engine(), mixed=True)


def test_abort_with_a_decode_in_flight(eng):
    set_overlap(eng, False)
    reqs, late = workload("a", False)
    clean = run(eng, reqs, late)
    set_overlap(eng, True)
    clean_pools(eng)
    reqs, late = workload("a", False)
    in_flight, real_abort = [], eng.abort

    def abort(rid):  # noqa: ANN001, ANN202
        in_flight.append(eng.scheduler._inflight is not None)  # the aborted row rides in the undelivered decode
        real_abort(rid)

    eng.abort = abort
    try:
        got = run(eng, reqs, late, abort={"a-3": 5})
    finally:
        del eng.abort
    assert in_flight and all(in_flight)
    toks, _, _, reason, _ = got["a-3"]
    assert reason == "abort" and 5 <= len(toks) < 15 and toks == clean["a-3"][0][:len(toks)]
    assert {k: v for k, v in got.items() if k != "a-3"} == {k: v for k, v in clean.items() if k != "a-3"}
    assert clean_pools(eng)


def test_fault_fails_only_its_request_with_overlap(eng):
    """A stale write into a decoding request's page while decodes are in flight: that request ends with
    KVIntegrityError (tokens up to the fault are kept, none after), everyone else matches the clean run."""
    set_overlap(eng, True)
    reqs, late = workload("f", False)
    clean = run(eng, reqs, late)
    clean_pools(eng)
    reqs, late = workload("f", False)
    victim, hit = "f-3", []
    real_step = eng.step

    def step():  # noqa: ANN202
        seq = next((s for s in eng.scheduler.running if s.req.request_id == victim and len(s.generated) >= 4), None)
        if seq is not None and not hit:
            page, tag = seq.decode_pages[0]
            stray_write(eng.programs, "decode", page, stale(tag))
            hit.append(len(seq.generated))
            hit.append(eng.scheduler._inflight is not None)
        real_step()

    eng.step = step
    try:
        got = run(eng, reqs, late)
    finally:
        del eng.step
    assert hit and hit[1]  # a decode was in flight when the page was overwritten
    toks, _, _, reason, err = got[victim]
    assert reason == "error" and isinstance(err, KVIntegrityError) and err.value == victim
    # the decode in flight when the page was overwritten had passed its check already: at most its token is kept
    assert hit[0] <= len(toks) <= hit[0] + 1 and toks == clean[victim][0][:len(toks)]
    assert {k: v for k, v in got.items() if k != victim} == {k: v for k, v in clean.items() if k != victim}
    assert clean_pools(eng)

