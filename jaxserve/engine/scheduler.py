"""Continuous batching: FCFS admission by free pages, chunked prefill interleaved with decode, hand-off of finished
prefills to the decode pool, preemption by recompute, aborts, ends (`engine.output`: why a token ends a sequence; its
text and stop strings are the consumer's, `engine.text_stream`). The batches it uploads are built in `engine.batch`.

Prefill and decode as separate servers (`EngineConfig.role`): `remote_steps` (a mixin) exports instead of handing off
(prefill role) or pulls instead of prefilling (decode role).

Every path that ends a sequence (finish, abort, integrity failure, preemption) returns its pages to the pools.
The scheduler is single-threaded: only the engine loop calls `step()`; other threads talk to it through `submit`
and `abort`, which only touch a locked inbox.

Failures are contained per request: a KV tag mismatch (prefill, hand-off or decode) or an allocator error in one
request's bookkeeping ends that request with its error (`_fail`), drops prefix-cache entries whose pages no longer
hold their tag on the device, and the step goes on for everyone else.

Overlap (`EngineConfig.overlap`): the decode of step N+1 is dispatched before step N's tokens are read, so the host's
work for a step (intake, prefill, hand-offs, building the next batch) runs while the device decodes.
A row that was in N takes N's sampled token on the device (`batch.unpack_decode_after`), its position and seed step one
ahead; a row that joined since takes its host token. Rows that end at N for certain (max_tokens, context) are left
out of N+1; a row that ends at N otherwise (stop token, stop string, a failed tag check, an abort) was also in N+1,
and N+1's result for it is dropped. Its pages are freed after N is read, when N+1 is already queued: programs run in
dispatch order on the threaded pool, so N+1's write into such a page lands before the tag sync that zeroes it, and
long before any new owner's (re-tagged) write or read. Batches with a row that needs host-side per-token state
(`Sequence.special`: penalties, min_tokens, a grammar, top logprobs), DP attention, and steps whose next page
cannot be had without a preemption run one step at a time (dispatch, read, then the next).
With `EngineConfig.speculative` the decode phase of a step is `engine.speculative.Speculation.step` instead.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.cache import PageAllocator
from jaxserve.config import ModelConfig
from jaxserve.engine.batch import (DecodeRows, SamplingExtras, prefill_batch, rank_rows, sampling_arrays,
                                   sampling_extras)
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.fallback import CompiledShapes, fit
from jaxserve.engine.output import token_end, top_alternatives
from jaxserve.engine.placement import Placement
from jaxserve.engine.prefix_cache import PrefixCache, engine_salt
from jaxserve.engine.remote_steps import RemoteSteps
from jaxserve.engine.kv_transfer import Puller, TransferStore
from jaxserve.engine.programs import Programs
from jaxserve.engine.request import Request, Status, TokenEvent
from jaxserve.engine.sampling import Sampled, SamplingArrays
from jaxserve.engine.scoring import prompt_result, score_targets, take_scores, wants_scores
from jaxserve.engine.sequence import Sequence, Stats
from jaxserve.engine.speculative import Speculation
from jaxserve.engine.structured import GrammarCompiler
from jaxserve.errors import JaxserveError, KVIntegrityError, OutOfPagesError, PageAllocatorError

Emit = Callable[[TokenEvent], bool]  # -> True: the consumer ends the request now with "stop" (a stop string)


@dataclass(frozen=True)
class _InFlight:
    """A dispatched decode not read yet: its device outputs, and (sequence, DecodeRows slot, batch row, the
    sequence's preemption count) per row, to recognise rows that ended meanwhile."""

    pending: tuple[Sampled, jax.Array]
    rows: list[tuple[Sequence, int, int, int]]
    top_n: int


def _live(seq: Sequence, slot: int, preemptions: int) -> bool:
    """The row is still the same decoding sequence it was at dispatch."""
    return seq.status is Status.DECODING and seq.slot == slot and seq.preemptions == preemptions


class Scheduler(RemoteSteps):
    """The serving policy over the prefill and decode page pools: which sequences prefill, move, decode, wait.
    transfers / puller: a prefill / decode server's side of KV transfers (`remote_steps`)."""

    def __init__(self, programs: Programs, model_cfg: ModelConfig, cfg: EngineConfig, emit: Emit,
                 tokenizer: object | None = None, grammar: GrammarCompiler | None = None,
                 transfers: TransferStore | None = None, puller: Puller | None = None) -> None:
        self.programs = programs
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.emit = emit
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.transfers, self.puller = transfers, puller
        self.ranks = cfg.dp_ranks
        self.shapes: CompiledShapes | None = None  # --warmup fast: steps pad to compiled shapes (engine.fallback)
        self.prefill_alloc = PageAllocator(cfg.num_prefill_pages, shards=self.ranks)
        self.decode_alloc = PageAllocator(cfg.num_decode_pages, shards=self.ranks)
        self.rows = DecodeRows(cfg.max_batch, cfg.max_pages_per_seq, cfg.page_size)
        # one prefix cache per DP attention rank: a cached page is only readable on its own rank's devices
        salt = engine_salt(model_cfg, cfg.prefill_weights, programs.layouts.prefill.dtype, cfg.dtype)
        self.prefix_caches = [PrefixCache(self.prefill_alloc, cfg.page_size, salt) for _ in range(self.ranks)] \
            if cfg.prefix_cache and "prefill" in cfg.phases else []
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # prefilling or decoding, in admission order
        self.place = Placement(cfg, self.decode_alloc, self.running, self.prefix_caches)
        self.stats = Stats()
        self._order = 0
        self._inbox: list[Sequence] = []
        self._aborts: dict[str, str] = {}  # request id -> finish reason
        self._inflight: _InFlight | None = None  # the decode dispatched but not read yet (overlap)
        self._lock = threading.Lock()
        self._speculation = Speculation(self) if cfg.speculative is not None else None  # engine.speculative
        self.eos = set(model_cfg.eos_token_ids)
        if tokenizer is not None:
            self.eos |= set(getattr(tokenizer, "eos_token_ids", ()) or ())

    # ---- cross-thread entry points ------------------------------------------------------------------------
    def submit(self, req: Request, matcher: object | None = None) -> None:
        """Queue a validated request; `matcher` constrains it to a grammar (engine.structured)."""
        with self._lock:
            self._inbox.append(Sequence(req, order=-1, matcher=matcher))

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End the request at the next step with `reason` ("stop": its consumer found a stop string)."""
        with self._lock:
            self._aborts.setdefault(request_id, reason)

    def pending(self) -> int:
        with self._lock:
            return len(self._inbox)

    def has_work(self) -> bool:
        with self._lock:
            busy = self._inbox or self._aborts or self.waiting
        return bool(busy or any(s.status is not Status.PULLING for s in self.running) or self.remote_work())

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> None:
        """One scheduling iteration: intake, aborts, admission, a prefill batch, hand-offs, a decode batch (with
        overlap: the next decode is dispatched, then the one dispatched last step is read)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, {}
        for seq in inbox:
            seq.order = self._order
            self._order += 1
            self.waiting.append(seq)
        for rid, reason in aborts.items():
            self._abort(rid, reason)
        self._remote_events()
        self._admit()
        self._prefill_step()
        (self._speculation.step if self._speculation else self._decode_step)()
        self.stats.steps += 1

    def _abort(self, rid: str, reason: str) -> None:
        for seq in list(self.waiting) + self.running:
            if seq.req.request_id == rid:
                self._finish(seq, reason)
                self.stats.aborted += reason == "abort"

    # ---- admission ----------------------------------------------------------------------------------------
    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (rank 0's under DP attention)."""
        return self.prefix_caches[0] if self.prefix_caches else None

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_batch:
            seq = self.waiting[0]
            try:
                if not self._admit_one(seq):
                    return
            except (PageAllocatorError, KVIntegrityError) as err:  # this request's bookkeeping only
                self._fail(seq, err)

    def _admit_one(self, seq: Sequence) -> bool:
        """Give the first waiting sequence a rank and its prefill pages (prefix-cache hits first). -> False if it
        must wait."""
        if seq.req.pull is not None:
            return self._admit_pull(seq)
        tokens = seq.tokens
        rank = self.place.rank_for(tokens, seq.req.cache_salt)
        if rank is None:
            return False  # FCFS: nobody overtakes a request that waits for decode pages
        if self.cfg.deterministic and not self.place.fits_to_the_end(seq, rank):
            return False  # never preempt: a recompute (prefill's path, not decode's) would change its tokens
        cache = self.prefix_caches[rank] if self.prefix_caches else None
        # a scoring request recomputes its prompt: cached positions would have no logits (engine.scoring)
        cached = cache.lookup(tokens, seq.req.cache_salt) if cache and not wants_scores(seq) else []
        need = self.place.pages_for(len(tokens)) - len(cached)
        fresh = self._allocate(self.prefill_alloc, need, evict=True, rank=rank)
        if fresh is None:
            self._release(self.prefill_alloc, cached)
            return False
        self.waiting.popleft()
        seq.rank = rank
        seq.prefill_pages = cached + fresh
        seq.target = len(tokens)
        seq.computed = len(cached) * self.cfg.page_size
        if not seq.generated:
            seq.cached_tokens = seq.computed
            self.stats.prompt_tokens += len(tokens)
            self.stats.cached_tokens += seq.computed
        seq.status = Status.PREFILLING
        self.running.append(seq)
        return True

    def _allocate(self, alloc: PageAllocator, n: int, *, evict: bool, rank: int) -> list[tuple[int, int]] | None:
        if n <= 0:
            return []
        if alloc.num_free_in(rank) < n and evict and self.prefix_caches:
            self.prefix_caches[rank].evict(n - alloc.num_free_in(rank))
        try:
            return alloc.allocate(n, shard=rank)
        except OutOfPagesError:
            return None

    # ---- prefill ------------------------------------------------------------------------------------------
    def _prefill_step(self) -> None:
        cfg, ps = self.cfg, self.cfg.page_size
        budget = cfg.max_prefill_tokens
        rows: list[tuple[Sequence, int, int]] = []  # (seq, start, n)
        widest = 0
        for seq in self.running:
            if seq.status is not Status.PREFILLING or seq.computed >= seq.target or budget <= 0 or \
                    rows and wants_scores(seq) != wants_scores(rows[0][0]):  # scoring rows run their own program
                continue
            n = min(cfg.prefill_chunk, seq.target - seq.computed, budget)
            b, _ = rank_rows([s.rank for s, _, _ in rows] + [seq.rank], self.ranks, cfg.row_buckets)
            slots = b * cfg.pick(cfg.chunk_buckets, max(widest, n))
            if rows and slots > cfg.prefill_slots:
                break  # padded rows x chunk would exceed the step's token slots (see EngineConfig.prefill_shapes)
            rows.append((seq, seq.computed, n))
            widest = max(widest, n)
            budget -= n
        if rows:
            B, place = rank_rows([s.rank for s, _, _ in rows], self.ranks, cfg.row_buckets)
            T = cfg.pick(cfg.chunk_buckets, widest)
            M = cfg.pick(cfg.prefill_page_buckets, max(self.place.pages_for(s + n) for _, s, n in rows))
            kind = "prefill_scored" if wants_scores(rows[0][0]) else "prefill"  # its own program (scoring.py)
            B, place, M, T = fit(self.shapes, kind, [s.rank for s, _, _ in rows], self.ranks, B, place, M, T)
            batch = prefill_batch(rows, place, B, T, M, ps)
            by_row: list[Sequence | None] = [None] * B
            for i, (seq, _, _) in zip(place, rows):
                by_row[i] = seq
            self.programs.sync_tags(self.prefill_alloc, self.decode_alloc)
            samp, targets = sampling_arrays(by_row, self._extras(by_row)), score_targets(rows, place, B, T)
            if self._speculation is not None and targets[0] is None:  # "mtp:K": the prefill drafts too
                out, ok, scores = *self._speculation.prefill(rows, place, batch, samp), None
            else:
                out, ok, scores = self.programs.run_prefill(batch, samp, *targets)
            for i, (seq, start, n) in zip(place, rows):
                if not ok[i]:  # its context (prefix-cache pages included) no longer holds its tags: it read nothing
                    self._fail(seq, self._integrity_error(seq, "prefill"))
                    continue
                seq.computed = start + n
                if scores is not None:
                    take_scores(seq, scores, i, start, n)
                if seq.computed == seq.target:
                    self._guarded(seq, self._complete_prefill, seq, int(out.tokens[i]), float(out.logprobs[i]),
                                  top_alternatives(out, i, seq))
        # every prefilled sequence moves to the decode pool together (retried each step while that pool is full)
        done = [s for s in self.running if s.status is Status.PREFILLING and s.computed == s.target
                and not s.decode_pages]
        self._exports(done) if self.cfg.role == "prefill" else self._handoffs(done)

    def _extras(self, seqs: list[Sequence | None]) -> SamplingExtras:
        return sampling_extras(seqs, self.model_cfg.vocab_size, self.eos, self.grammar)

    def _complete_prefill(self, seq: Sequence, token: int, logprob: float, top: tuple = ()) -> None:
        if self.prefix_caches:
            self.prefix_caches[seq.rank].insert(seq.tokens[: seq.target], seq.prefill_pages, seq.req.cache_salt)
        seq.pending = (token, logprob, top)  # the first token; emitted once the hand-off is done
        if seq.req.params.max_tokens == 0:  # scored the prompt only
            self._finish(seq, "length")

    def _handoffs(self, seqs: list[Sequence]) -> None:
        """Move prefilled sequences to the decode pool: decode pages for each (one that gets none waits for the
        next step), then one hand-off program per group of sequences up to the largest page bucket. Each sequence's
        pages are tag-checked as their own group, so a stray write fails only its owner."""
        moving: list[tuple[Sequence, list[tuple[int, int]]]] = []
        for seq in seqs:
            pages = self._guarded(seq, lambda s=seq: self._allocate(self.decode_alloc, len(s.prefill_pages),
                                                                    evict=False, rank=s.rank))
            if pages is not None:  # None: no room yet, or the request failed
                moving.append((seq, pages))
        cap = self.cfg.prefill_page_buckets[-1]  # one sequence's pages always fit (max_pages_per_seq)
        while moving:
            group, n = [], 0
            while moving and (not group or n + len(moving[0][1]) <= cap):
                n += len(moving[0][1])
                group.append(moving.pop(0))
            # tags first: the import verifies the source tags and stamps the new pages' (0 if the check fails)
            self.programs.sync_tags(self.prefill_alloc, self.decode_alloc)
            self.programs.handoff([p for seq, _ in group for p, _ in seq.prefill_pages],
                                  [p for _, pages in group for p, _ in pages],
                                  [t for seq, _ in group for _, t in seq.prefill_pages],
                                  [t for _, pages in group for _, t in pages],
                                  [g for g, (seq, _) in enumerate(group) for _ in seq.prefill_pages])
            for seq, pages in group:
                self._guarded(seq, self._handed_off, seq, pages)

    def _handed_off(self, seq: Sequence, pages: list[tuple[int, int]]) -> None:
        """Bookkeeping after seq's pages were copied to `pages` of the decode pool: it decodes from now on."""
        self._release(self.prefill_alloc, seq.prefill_pages)
        seq.prefill_pages = []
        seq.decode_pages = pages
        seq.decode_len = seq.target
        seq.status = Status.DECODING
        self.rows.assign(seq)
        token, logprob, top = seq.pending
        seq.pending = None
        self._accept(seq, token, logprob, top)
        self.rows.accepted(seq)

    # ---- decode -------------------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        """Read the decode in flight (if any) and dispatch the next; with overlap, the next is dispatched first."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            ahead = self._dispatch_ahead(prev)
            self._collect(prev)  # blocks on the device; `ahead` is already queued behind it
            if ahead is not None:
                self.stats.overlapped += 1
                self._inflight = ahead
                return
        # one step at a time: nothing is in flight from here on
        ps = self.cfg.page_size
        for seq in [s for s in self.running if s.status is Status.DECODING]:
            if seq.status is Status.DECODING and seq.decode_len == len(seq.decode_pages) * ps:
                self._guarded(seq, self._grow, seq)  # may preempt the youngest rows, this one included
        ready = [s for s in self.running if s.status is Status.DECODING]
        if not ready:
            return
        if self.ranks > 1:
            ready.sort(key=lambda s: s.rank)  # each rank's rows are one contiguous block of the batch
        flight = self._dispatch(ready)
        if self.cfg.overlap and self.ranks == 1 and not any(s.special for s in ready):  # top logprobs: special
            self._inflight = flight  # read in the next step, after the step after it is dispatched
        else:
            self._collect(flight)

    def _dispatch_ahead(self, prev: _InFlight) -> _InFlight | None:
        """Dispatch the decode after `prev` before reading it, or None when that cannot be exact (a row needs host
        state per token, or a page the next position needs is not free without a preemption)."""
        ps = self.cfg.page_size
        live = {id(seq): row for seq, slot, row, pre in prev.rows if _live(seq, slot, pre)}
        decoding = [s for s in self.running if s.status is Status.DECODING]
        if any(s.special for s in decoding):
            return None
        ready: list[Sequence] = []
        ahead: list[int] = []
        for seq in decoding:
            a = int(id(seq) in live)
            if a and seq.at_length_limit(self.cfg.max_model_len, pending=1):
                continue  # `prev`'s token ends it for certain
            ready.append(seq)
            ahead.append(a)
        if not ready:
            return None
        for seq, a in zip(ready, ahead):
            if seq.decode_len + a == len(seq.decode_pages) * ps:  # the position it writes opens a page
                pages = self._allocate(self.decode_alloc, 1, evict=False, rank=seq.rank)
                if pages is None:
                    return None  # the plain path grows with preemption, after `prev` is read
                seq.decode_pages += pages
                self.rows.add_page(seq, *pages[0])
        src = [live[id(s)] if a else -1 for s, a in zip(ready, ahead)]
        return self._dispatch(ready, np.asarray(ahead, np.int32), np.asarray(src, np.int32), prev)

    def _dispatch(self, ready: list[Sequence], ahead: np.ndarray | None = None, src: np.ndarray | None = None,
                  prev: _InFlight | None = None) -> _InFlight:
        """Upload and enqueue one decode of `ready` (see DecodeRows.packed for ahead / src; `prev` is the decode in
        flight whose tokens the ahead rows take). Returns without waiting for the device."""
        cfg = self.cfg
        n = len(ready)
        ranks = [s.rank for s in ready]
        B, place = rank_rows(ranks, self.ranks, cfg.row_buckets)
        idx = np.fromiter((s.slot for s in ready), np.int64, n)
        M = cfg.pick(cfg.page_buckets, int(self.rows.num_pages[idx].max()))
        B, place, M, _ = fit(self.shapes, "decode", ranks, self.ranks, B, place, M)
        self.programs.sync_tags(self.prefill_alloc, self.decode_alloc)
        batch, cols = self.rows.upload(idx, np.asarray(ranks, np.int64), self.ranks, B, M, self.programs.decode_rows,
                                       ahead, src, None if prev is None else prev.pending[0].tokens)
        mode = self.rows.sampling_mode(idx)
        by_row: list[Sequence | None] = [None] * B
        for i, seq in zip(place, ready):
            by_row[i] = seq
        extras = self._extras(by_row) if self.rows.special[idx].any() else SamplingExtras()
        samp = SamplingArrays(*cols, adjust=extras.adjust, mask=extras.mask, mode=mode, top_n=extras.top_n)
        pending = self.programs.dispatch_decode(batch, samp)
        return _InFlight(pending, [(seq, seq.slot, i, seq.preemptions) for i, seq in zip(place, ready)],
                         extras.top_n)

    def _collect(self, flight: _InFlight) -> None:
        """Read a dispatched decode and accept its tokens. Rows that ended (or were aborted) since it was
        dispatched are dropped: their slot may already be another sequence's."""
        out, ok = self.programs.read_decode(flight.pending)
        keep = [(seq, slot, i) for seq, slot, i, pre in flight.rows if _live(seq, slot, pre)]
        if not keep:
            return
        slots = np.fromiter((slot for _, slot, _ in keep), np.int64, len(keep))
        at = np.fromiter((i for _, _, i in keep), np.int64, len(keep))
        good = ok[at].astype(bool)
        self.rows.advance(slots, out.tokens[at], good)
        for (seq, _, i), tok, lp, fine in zip(keep, out.tokens[at].tolist(), out.logprobs[at].tolist(),
                                              good.tolist()):
            if not fine:
                self._fail(seq, self._integrity_error(seq, "decode"))
                continue
            seq.decode_len += 1
            self._accept(seq, tok, lp, top_alternatives(out, i, seq) if flight.top_n else ())

    def _grow(self, seq: Sequence) -> bool:
        """One more decode page for seq; preempts the youngest decoding sequences if the pool is full."""
        while True:
            pages = self._allocate(self.decode_alloc, 1, evict=False, rank=seq.rank)
            if pages is not None:
                seq.decode_pages += pages
                self.rows.add_page(seq, *pages[0])
                return True
            # only a sequence on the same rank frees a page this one can use
            victims = [s for s in self.running if s.status is Status.DECODING and s.rank == seq.rank]
            victim = max(victims, key=lambda s: s.order)
            self._preempt(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        """Free everything and requeue at the front; it will recompute prompt + generated tokens."""
        if self.cfg.role == "decode":
            return self._preempt_remote(seq)
        self._release(self.decode_alloc, seq.decode_pages)
        self._release(self.prefill_alloc, seq.prefill_pages)
        seq.decode_pages, seq.prefill_pages = [], []
        self.rows.release(seq)
        seq.status = Status.WAITING
        seq.computed = seq.decode_len = 0
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # ---- tokens, stops, ends ------------------------------------------------------------------------------
    def _accept(self, seq: Sequence, token: int, logprob: float, top: tuple = ()) -> None:
        """Take seq's next token: stream it and finish seq if it ends there (or its consumer ends it at once)."""
        seq.generated.append(token)
        seq.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        end = token_end(seq, token, self.eos, self.cfg.max_model_len)
        stop = self.emit(TokenEvent(seq.req.request_id, token_id=token, logprob=logprob, top_logprobs=top,
                                    prompt_logprobs=prompt_result(seq), end=end))
        if stop or end is not None:
            self._finish(seq, "length" if end == "length" and not stop else "stop")

    # ---- failures -----------------------------------------------------------------------------------------
    def _integrity_error(self, seq: Sequence, where: str) -> KVIntegrityError:
        return KVIntegrityError(f"KV page tags of request {seq.req.request_id!r} no longer match the device's at "
                                f"{where}; aborted (fail closed)", value=seq.req.request_id, param="request_id")

    def _guarded(self, seq: Sequence, fn: Callable[..., object], *args: object) -> object | None:
        """Run one request's bookkeeping step -> its result; an allocator or integrity error ends that request only
        (-> None)."""
        try:
            return fn(*args)
        except (PageAllocatorError, KVIntegrityError) as err:
            self._fail(seq, err)
            return None

    def _fail(self, seq: Sequence, err: JaxserveError) -> None:
        """End seq with `err` (its pages return); after a tag mismatch, drop the prefix-cache entries whose pages
        no longer carry their tag on the device (an overwritten page must not be served to the next request)."""
        if isinstance(err, KVIntegrityError):
            self.stats.tag_mismatches += 1
            if self.prefix_caches:
                device = self.programs.device_tags("prefill")
                for cache in self.prefix_caches:
                    cache.drop_mismatched(device)
        if seq.status is not Status.FINISHED:
            self._finish(seq, "error", err)

    def _release(self, alloc: PageAllocator, pages: list[tuple[int, int]]) -> None:
        for page, tag in pages:
            if alloc.tag(page) == tag and alloc.refcount(page) > 0:  # a stale page belongs to someone else now
                alloc.free(page, tag)

    def _finish(self, seq: Sequence, reason: str, error: JaxserveError | None = None) -> None:
        self._release(self.decode_alloc, seq.decode_pages)
        self._release(self.prefill_alloc, seq.prefill_pages)
        seq.decode_pages, seq.prefill_pages = [], []
        self.rows.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.stats.finished += 1
        self.emit(TokenEvent(seq.req.request_id, finish_reason=reason, error=error,
                             prompt_tokens=len(seq.req.prompt), cached_tokens=seq.cached_tokens,
                             completion_tokens=len(seq.generated), prompt_logprobs=prompt_result(seq),
                             kv_transfer=self._transfer_of(seq, reason)))

