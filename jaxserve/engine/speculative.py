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
no overlap then), as does the whole batch when no row has a draft, or when more rows run (prefilling ones too) than
`Speculative.max_rows`.

Overlap ("ngram:K", `EngineConfig.overlap`, one decode device): when every row speculates without a grammar or top
logprobs, the verify is left in flight and the next step dispatches the one after it from its device outputs
(`engine.spec_chain`: drafts by a device n-gram lookup), then reads it (one packed copy): the host's reading,
accepting and bookkeeping run while the device verifies. Rows keep the pages the verify in flight may write until a
verify is read with none after it; a row that joins (it needs host inputs) or a page not free without a preemption
ends the chain for a step; results for rows that ended meanwhile are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import jax
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
from jaxserve.engine.spec_chain import chain_host, chain_inputs, chain_start, chains, unpack_results
from jaxserve.engine.spec_grammar import GrammarDrafts, grammar_drafts, verify_extras
from jaxserve.engine.structured import GrammarCompiler
from jaxserve.engine.verify import Verified, upload_verify, verify_batch
from jaxserve.errors import KVIntegrityError
from jaxserve.models.paged import PrefillBatch


def _over_max_rows(s: SchedulerParts) -> bool:
    """More rows running than `Speculative.max_rows`: prefilling rows count, so a batch ramping up to many rows
    does not speculate while its first rows decode (c = 16 on the embedded model: 1.50 tokens a verify then)."""
    limit = s.cfg.speculative.max_rows
    return limit is not None and len(s.running) > limit


@dataclass
class _Flight:
    """A verify dispatched and not read yet (an n-gram chain): its device outputs, drafts per row, the (sequence,
    DecodeRows slot, batch row, preemption count) of its rows, and what `spec_chain.chain_inputs` needs to make the
    next verify from it; packed: its results, packed by the next verify's `chain_inputs` (None: not chained)."""

    out: Verified
    ok: jax.Array
    ndrafts: jax.Array
    rows: list[tuple[Sequence, int, int, int]]
    state: jax.Array
    hist: jax.Array
    columns: tuple[jax.Array, ...]
    mode: str
    b: int
    packed: jax.Array | None = None


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
        self._flight: _Flight | None = None  # the n-gram verify dispatched but not read yet (overlap)
        # chains need the verify's inputs where `chain_inputs` makes them (`spec_chain.chains`), on one rank
        self.chains = sched.ranks == 1 and chains(sched.cfg, sched.programs.decode_rows)

    def prefill(self, rows: list[tuple[Sequence, int, int]], place: list[int], batch: PrefillBatch,
                samp: SamplingArrays) -> tuple[Sampled, np.ndarray]:
        """The prefill program (the MTP one, which drafts too, for "mtp:K"): -> (Sampled, ok [B] bool)."""
        if self.mtp is not None:
            return self.mtp.prefill(rows, place, batch, samp)
        return self.s.programs.run_prefill(batch, samp)[:2]

    def step(self) -> None:
        """Grow pages (may preempt), draft, then run the plain decode for rows that cannot speculate and one verify
        for the rest; every token read is accepted before this returns, but an n-gram chain's: with a verify in
        flight, the next is dispatched from it on the device (`_chain`) before it is read."""
        s, ps = self.s, self.s.cfg.page_size
        flight, self._flight = self._flight, None
        if flight is not None:
            self._flight = self._chain(flight)
            self._land(flight, chained=self._flight is not None)
            if self._flight is not None:
                s.stats.overlapped += 1
                return
        if _over_max_rows(s):
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
        # MTP rows always verify: that program makes their next drafts; nor n-gram rows that may chain)
        spec = [x for x in ready if id(x) in drafts] \
            if any(d for d, _ in drafts.values()) or self.mtp or self._chainable(ready, drafts) else []
        plain = [x for x in ready if id(x) not in drafts or not spec]
        if s.ranks > 1:
            plain.sort(key=lambda x: x.rank)
            spec.sort(key=lambda x: x.rank)
        if plain:
            s._collect(s._dispatch(plain))
        if spec:
            self._verify(spec, [self._room(x, drafts[id(x)][0]) for x in spec], grammar, hold=not plain)

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

    def _verify(self, seqs: list[Sequence], drafts: list[list[int]], grammar: dict[int, GrammarDrafts],
                hold: bool = False) -> None:
        """One verify program over `seqs` with their drafts (grammar rows' masks in `grammar`, by id); each row's
        tokens go through `_accept`. hold (no plain rows this step): an n-gram batch without grammars or top
        logprobs is left in flight, to chain the next verify from it (`_chain`)."""
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
        elif hold and self._chainable(seqs, {id(x): x for x in seqs}):
            self._flight = self._start(seqs, place, drafts, (batch, draft_arr, cols), samp)
            return
        else:
            out, ok = s.programs.run_verify(batch, draft_arr, samp)
        top = extras.top_n
        for i, seq, d in zip(place, seqs, drafts):
            if not ok[i]:  # its pages no longer hold its tags: it wrote and read nothing
                s._fail(seq, s._integrity_error(seq, "verify"))
                continue
            count = min(int(out.count[i]), len(d) + 1)
            self._count(len(d), count)
            n = seq.req.params.top_logprobs
            alts = [tuple(zip(out.top_ids[i, j, :n].tolist(), out.top_logprobs[i, j, :n].tolist()))
                    for j in range(count)] if top else [()] * count
            self._emit(seq, out.tokens[i, :count].tolist(), out.logprobs[i, :count].tolist(), alts)

    def _chainable(self, rows: list[Sequence], speculating: dict) -> bool:
        """A verify of `rows` can start a chain: n-gram drafts, overlap on, every row speculating (`speculating`
        holds them by id), none with a grammar or top logprobs."""
        return self.chains and len(speculating) == len(rows) and all(
            id(x) in speculating and x.matcher is None and not x.req.params.top_logprobs for x in rows)

    def _count(self, drafts: int, count: int) -> None:
        st = self.s.stats
        st.verify_rows += 1
        st.draft_tokens += drafts
        st.accepted_tokens += count - 1

    def _start(self, seqs: list[Sequence], place: list[int], drafts: list[list[int]], uploaded: tuple,
               samp: SamplingArrays) -> _Flight:
        """Dispatch the host-built verify (`_verify`'s batch, already uploaded) without reading it: a chain's
        first, with its rows' token histories uploaded for `chain_inputs`."""
        s, (batch, draft_arr, cols) = self.s, uploaded
        b = draft_arr.shape[0]
        out, ok = s.programs.run_verify(batch, draft_arr, samp, read=False)
        state, hist = chain_start([x.tokens for x in seqs], place, [x.decode_len for x in seqs],
                                  [len(x.generated) for x in seqs], [x.req.params.max_tokens for x in seqs], b,
                                  s.cfg.max_model_len + self.k + 1)
        nd = np.zeros(b, np.int32)
        nd[place] = [len(d) for d in drafts]
        state, hist, nd = jax.device_put((state, hist, nd))
        return _Flight(out, ok, nd, [(x, x.slot, i, x.preemptions) for x, i in zip(seqs, place)], state, hist,
                       cols, samp.mode, b)

    def _chain(self, f: _Flight) -> _Flight | None:
        """Dispatch the verify after `f` from its device outputs (`spec_chain.chain_inputs`) before `f` is read, or
        None when that cannot be: a decoding row not in `f` (it needs host inputs), more rows than max_rows, a
        shape the fallback pads, or a row whose next first position has no page free without a preemption."""
        s, cfg, ps, k1 = self.s, self.s.cfg, self.s.cfg.page_size, self.k + 1
        live = [(seq, i) for seq, slot, i, pre in f.rows if _live(seq, slot, pre)]
        decoding = [x for x in s.running if x.status is Status.DECODING]
        if {id(x) for x in decoding} != {id(seq) for seq, _ in live} or _over_max_rows(s):
            return None
        go = [(seq, i) for seq, i in live if not seq.at_length_limit(cfg.max_model_len, pending=1)]
        for seq, _ in go:  # pages for every position the next verify may write, the first one at least
            need = -(-(seq.decode_len + k1 + 1) // ps)
            for _ in range(min(-(-(seq.decode_len + 2 * k1) // ps), cfg.max_pages_per_seq) - len(seq.decode_pages)):
                pages = s._allocate(s.decode_alloc, 1, evict=False, rank=seq.rank)
                if pages is None:
                    break
                seq.decode_pages += pages
                s.rows.add_page(seq, *pages[0])
            if len(seq.decode_pages) < need:
                return None
        if not go:
            return None
        M = cfg.pick(cfg.page_buckets, max(int(s.rows.num_pages[seq.slot]) for seq, _ in go))
        B, place, M, _ = fit(s.shapes, "verify", [0] * len(go), 1, f.b, [i for _, i in go], M)
        if B != f.b or place != [i for _, i in go]:
            return None
        r = s.rows
        host = chain_host([(i, r.num_pages[x.slot], r.tables[x.slot], r.tags[x.slot]) for x, i in go], B, M)
        s.programs.sync_tags(s.prefill_alloc, s.decode_alloc)
        batch, drafts, cols, state, hist, nd, f.packed = chain_inputs(
            f.out.tokens, f.out.count, f.out.logprobs, f.ok, f.ndrafts, f.state, f.hist, f.columns,
            jax.device_put(host), page_size=ps, max_model_len=cfg.max_model_len)
        out, ok = s.programs.run_verify(batch, drafts, SamplingArrays(*cols, mode=f.mode), read=False)
        return _Flight(out, ok, nd, [(x, x.slot, i, x.preemptions) for x, i in go], state, hist, cols, f.mode, B)

    def _land(self, f: _Flight, chained: bool) -> None:
        """Read a verify left in flight (one copy when the next was chained from it) and accept its rows' tokens;
        rows that ended since it was dispatched are dropped. chained: the next verify is in flight, so the rows
        keep the pages it may write."""
        s = self.s
        if f.packed is not None:
            tokens, logprobs, count, ok, nd = unpack_results(np.asarray(f.packed))
        else:
            tokens, logprobs, count, ok, nd = (np.asarray(x) for x in (f.out.tokens, f.out.logprobs, f.out.count,
                                                                      f.ok, f.ndrafts))
        for seq, slot, i, pre in f.rows:
            if not _live(seq, slot, pre):
                continue
            if not ok[i]:
                s._fail(seq, s._integrity_error(seq, "verify"))
                continue
            c = min(int(count[i]), int(nd[i]) + 1)
            self._count(int(nd[i]), c)
            self._emit(seq, tokens[i, :c].tolist(), logprobs[i, :c].tolist(), [()] * c, keep=chained)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[float], tops: list[tuple],
              keep: bool = False) -> None:
        """Accept a row's verified tokens one by one (each one's input is now in the pool) until one ends it, then
        give back the pages past its accepted length (keep: not while a verify in flight may write them) and mirror
        its state into DecodeRows."""
        s, ps = self.s, self.s.cfg.page_size
        start = seq.decode_len
        for j, (tok, lp, top) in enumerate(zip(tokens, logprobs, tops)):
            seq.decode_len = start + j + 1
            s._accept(seq, tok, lp, top)
            if seq.status is not Status.DECODING:
                return  # finished: every page went back
        if not keep:
            n = -(-seq.decode_len // ps)
            extra, seq.decode_pages = seq.decode_pages[n:], seq.decode_pages[:n]
            s._release(s.decode_alloc, extra)
            s.rows.num_pages[seq.slot] = n
        s.rows.length[seq.slot] = seq.decode_len
        s.rows.accepted(seq)


def _live(seq: Sequence, slot: int, preemptions: int) -> bool:
    """The row is still the same decoding sequence it was at dispatch."""
    return seq.status is Status.DECODING and seq.slot == slot and seq.preemptions == preemptions
