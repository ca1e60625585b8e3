"""Speculative decoding's host side: the decode phase of a scheduler step when `EngineConfig.speculative` is set.

Each decoding row gets up to k draft tokens (n-gram prompt lookup over its prompt + output, `engine.ngram`; for
"mtp:K" / "eagle3:PATH:K" the drafts the row's last MTP / EAGLE-3 prefill / verify program made,
`engine.mtp_draft`), and
one verify program (`engine.verify`) runs the target over the last token + the drafts; each row emits 1..k+1
tokens through the scheduler's own output path (`Scheduler._accept`: stop ids, max_tokens, the context window,
logprobs; a stop string found by the consumer, engine.text_stream), stopping at the first that ends it.

Pages: the page of the position a plain decode would write is had as the plain path has it (`_grow`, which may
preempt the youngest rows); pages for the draft positions beyond it are taken only when free (no eviction, no
preemption; the drafts are cut to the pages the row holds otherwise). After the step a row keeps exactly the pages
its accepted tokens need: a rollback across a page boundary returns the page. Rejected positions' KV is never read
(a row's length stops at its accepted tokens) and is overwritten by its next step.

Greedy and sampled rows speculate (`acceptance.verify_tokens`: n-gram drafts are deterministic, so the rule is
exact for sampled rows too), top logprobs included, and so do rows with a grammar: their drafts are cut to what
the grammar allows and each verify position samples under the grammar's mask after the drafts before it
(`engine.spec_grammar`). Rows whose logits depend on other host state per token (penalties, logit_bias,
min_tokens, an open thinking budget) take the plain decode program in the same step (dispatched and read at once:
no overlap while speculating), as does the whole batch when no row has a draft, or when more rows decode than
`Speculative.max_rows`.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from jaxserve.cache import PageAllocator
from jaxserve.engine.batch import DecodeRows, rank_rows, sampling_arrays, sampling_columns
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.fallback import fit
from jaxserve.engine.mtp_draft import MTPDrafts
from jaxserve.engine.ngram import ngram_drafts
from jaxserve.engine.programs import Programs
from jaxserve.engine.request import Status
from jaxserve.engine.sampling import Sampled, SamplingArrays
from jaxserve.engine.sequence import Sequence, Stats
from jaxserve.engine.spec_grammar import GrammarDrafts, grammar_drafts, verify_extras
from jaxserve.engine.structured import GrammarCompiler
from jaxserve.engine.verify import upload_verify, verify_batch
from jaxserve.errors import KVIntegrityError
from jaxserve.models.paged import PrefillBatch


class SchedulerParts(Protocol):
    """What the speculative step uses of the scheduler (engine.scheduler; not imported: only the engine does)."""

    cfg: EngineConfig
    programs: Programs
    grammar: GrammarCompiler | None
    rows: DecodeRows
    running: list[Sequence]
    ranks: int
    stats: Stats
    decode_alloc: PageAllocator
    prefill_alloc: PageAllocator
    _inflight: object

    def _collect(self, flight: object) -> None: ...
    def _decode_step(self) -> None: ...
    def _dispatch(self, ready: list[Sequence]) -> object: ...
    def _grow(self, seq: Sequence) -> bool: ...
    def _guarded(self, seq: Sequence, fn: object, *args: object) -> object | None: ...
    def _allocate(self, alloc: PageAllocator, n: int, *, evict: bool, rank: int) -> list[tuple[int, int]] | None: ...
    def _release(self, alloc: PageAllocator, pages: list[tuple[int, int]]) -> None: ...
    def _accept(self, seq: Sequence, token: int, logprob: float, top: tuple = ()) -> None: ...
    def _fail(self, seq: Sequence, err: KVIntegrityError) -> None: ...
    def _integrity_error(self, seq: Sequence, where: str) -> KVIntegrityError: ...


def speculates(seq: Sequence) -> bool:
    """The row can take drafts: its logits need no host state per token but a grammar's mask (no penalties,
    biases, min_tokens, open thinking budget)."""
    return not seq.req.params.adjusts_logits and (seq.budget is None or seq.budget.closed)


class Speculation:
    """The decode phase of each scheduler step with drafts (see the module docstring)."""

    def __init__(self, sched: SchedulerParts) -> None:
        spec = sched.cfg.speculative
        self.s = sched
        self.k = spec.k
        # "mtp:K" / "eagle3:PATH:K": drafts come out of the device programs (engine.mtp_draft); "ngram:K": the host
        self.mtp = MTPDrafts(sched.programs.mtp, spec.k) if spec.method in ("mtp", "eagle3") else None

    def prefill(self, rows: list[tuple[Sequence, int, int]], place: list[int], batch: PrefillBatch,
                samp: SamplingArrays) -> tuple[Sampled, np.ndarray]:
        """The prefill program (the MTP one, which drafts too, for "mtp:K"): -> (Sampled, ok [B] bool)."""
        if self.mtp is not None:
            return self.mtp.prefill(rows, place, batch, samp)
        return self.s.programs.run_prefill(batch, samp)[:2]

    def step(self) -> None:
        """Grow pages (may preempt), draft, then run the plain decode for rows that cannot speculate and one verify
        for the rest; every token read is accepted before this returns."""
        s, ps = self.s, self.s.cfg.page_size
        limit = s.cfg.speculative.max_rows
        if limit is not None and sum(x.status is Status.DECODING for x in s.running) > limit:
            s._decode_step()  # too many rows for drafts to pay: the plain (overlapped) decode
            return
        if s._inflight is not None:  # a plain decode left in flight by an overlapped step: read it first
            prev, s._inflight = s._inflight, None
            s._collect(prev)
        for seq in [x for x in s.running if x.status is Status.DECODING]:
            if seq.status is Status.DECODING and seq.decode_len == len(seq.decode_pages) * ps:
                s._guarded(seq, s._grow, seq)  # may preempt the youngest rows, this one included
        ready = [x for x in s.running if x.status is Status.DECODING]
        if self.mtp is not None:
            self.mtp.prune(s.running)
        drafts = {id(x): self._drafts(x) for x in ready if speculates(x)}
        grammar = {key: g for key, (_, g) in drafts.items() if g is not None}
        # rows without a draft ride along in the verify (as a plain decode); with no draft at all, no verify (but
        # MTP rows always verify: that program makes their next drafts)
        spec = [x for x in ready if id(x) in drafts] if any(d for d, _ in drafts.values()) or self.mtp else []
        plain = [x for x in ready if id(x) not in drafts or not spec]
        if s.ranks > 1:
            plain.sort(key=lambda x: x.rank)
            spec.sort(key=lambda x: x.rank)
        if plain:
            s._collect(s._dispatch(plain))
        if spec:
            self._verify(spec, [self._room(x, drafts[id(x)][0]) for x in spec], grammar)

    def _drafts(self, seq: Sequence) -> tuple[list[int], GrammarDrafts | None]:
        """Up to k drafts, no more than the row may still emit (max_tokens, the context window) less one; a grammar
        row's cut to what its grammar allows (then what it forces), with their masks."""
        p, cfg = seq.req.params, self.s.cfg
        limit = min(self.k, p.max_tokens - len(seq.generated) - 1, cfg.max_model_len - 2 - seq.decode_len)
        if self.mtp is not None:
            drafts = self.mtp.take(seq, limit)
        else:
            drafts = ngram_drafts(seq.tokens, limit)[:limit] if limit > 0 else []
        if seq.matcher is None:
            return drafts, None
        g = grammar_drafts(seq.matcher, self.s.grammar, drafts, limit)
        return g.tokens, g

    def _room(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts cut to the pages the row holds or can have free (positions decode_len .. + len(drafts))."""
        s, ps = self.s, self.s.cfg.page_size
        need = -(-(seq.decode_len + len(drafts) + 1) // ps) - len(seq.decode_pages)
        if need > 0:
            pages = s._allocate(s.decode_alloc, need, evict=False, rank=seq.rank)
            if pages is None:
                return drafts[: len(seq.decode_pages) * ps - seq.decode_len - 1]
            seq.decode_pages += pages
            for page, tag in pages:
                s.rows.add_page(seq, page, tag)
        return drafts

    def _verify(self, seqs: list[Sequence], drafts: list[list[int]], grammar: dict[int, GrammarDrafts]) -> None:
        """One verify program over `seqs` with their drafts (grammar rows' masks in `grammar`, by id); each row's
        tokens go through `_accept`."""
        s, cfg = self.s, self.s.cfg
        B, place = rank_rows([x.rank for x in seqs], s.ranks, cfg.row_buckets)
        idx = np.fromiter((x.slot for x in seqs), np.int64, len(seqs))
        M = cfg.pick(cfg.page_buckets, int(s.rows.num_pages[idx].max()))
        B, place, M, _ = fit(s.shapes, "verify", [x.rank for x in seqs], s.ranks, B, place, M)
        by_row: list[Sequence | None] = [None] * B
        for i, seq in zip(place, seqs):
            by_row[i] = seq
        batch, draft_arr = verify_batch(s.rows, idx, place, drafts, B, self.k, M)
        batch, draft_arr, cols = upload_verify(batch, draft_arr, sampling_columns(by_row), s.programs.decode_rows)
        s.programs.sync_tags(s.prefill_alloc, s.decode_alloc)
        extras = verify_extras(by_row, grammar, drafts, place, self.k, s.programs.forms.vocab)
        samp = sampling_arrays(by_row, extras, cols)
        if self.mtp is not None:
            out, ok, nxt = s.programs.mtp.run_verify(batch, draft_arr, samp)
            self.mtp.verified(seqs, place, nxt, ok)
        else:
            out, ok = s.programs.run_verify(batch, draft_arr, samp)
        for i, seq, d in zip(place, seqs, drafts):
            if not ok[i]:  # its pages no longer hold its tags: it wrote and read nothing
                s._fail(seq, s._integrity_error(seq, "verify"))
                continue
            count = min(int(out.count[i]), len(d) + 1)
            s.stats.verify_rows += 1
            s.stats.draft_tokens += len(d)
            s.stats.accepted_tokens += count - 1
            top = seq.req.params.top_logprobs
            alts = [tuple(zip(out.top_ids[i, j, :top].tolist(), out.top_logprobs[i, j, :top].tolist()))
                    for j in range(count)] if extras.top_n else [()] * count
            self._emit(seq, out.tokens[i, :count].tolist(), out.logprobs[i, :count].tolist(), alts)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[float], tops: list[tuple]) -> None:
        """Accept a row's verified tokens one by one (each one's input is now in the pool) until one ends it, then
        give back the pages past its accepted length and mirror its state into DecodeRows."""
        s, ps = self.s, self.s.cfg.page_size
        start = seq.decode_len
        for j, (tok, lp, top) in enumerate(zip(tokens, logprobs, tops)):
            seq.decode_len = start + j + 1
            s._accept(seq, tok, lp, top)
            if seq.status is not Status.DECODING:
                return  # finished: every page went back
        keep = -(-seq.decode_len // ps)
        extra, seq.decode_pages = seq.decode_pages[keep:], seq.decode_pages[:keep]
        s._release(s.decode_alloc, extra)
        s.rows.num_pages[seq.slot] = keep
        s.rows.length[seq.slot] = seq.decode_len
        s.rows.accepted(seq)
