"""Continuous batching: FCFS admission by free pages, chunked prefill interleaved with decode, hand-off of finished
prefills to the decode pool, preemption by recompute when decode pages run out, aborts, stop conditions.

Every path that ends a sequence (finish, abort, integrity failure, preemption) returns its pages to the pools.
The scheduler is single-threaded: only the engine loop calls `step()`; other threads talk to it through `submit`
and `abort`, which only touch a locked inbox.

Failures are contained per request: a KV tag mismatch (prefill, hand-off or decode) or an allocator error in one
request's bookkeeping ends that request with its error (`_fail`), drops prefix-cache entries whose pages no longer
hold their tag on the device, and the step goes on for everyone else.

Overlap (`EngineConfig.overlap`): the decode of step N+1 is dispatched before step N's tokens are read, so the host's
work for a step (intake, prefill, hand-offs, building the next batch, stop strings) runs while the device decodes.
A row that was in N takes N's sampled token on the device (`_unpack_decode_after`), its position and seed step one
ahead; a row that joined since takes its host token. Rows that end at N for certain (max_tokens, context) are left
out of N+1; a row that ends at N otherwise (stop token, stop string, a failed tag check, an abort) was also in N+1,
and N+1's result for it is dropped. Its pages are freed after N is read, when N+1 is already queued: programs run in
dispatch order on the threaded pool, so N+1's write into such a page lands before the tag sync that zeroes it, and
long before any new owner's (re-tagged) write or read. Batches with a row that needs host-side per-token state
(`Sequence.special`: penalties, min_tokens, a grammar, top logprobs), DP attention, and steps whose next page
cannot be had without a preemption run one step at a time (dispatch, read, then the next).
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache import NULL_PAGE, PageAllocator
from jaxserve.config import ModelConfig
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.prefix_cache import PrefixCache, engine_salt
from jaxserve.engine.programs import Programs
from jaxserve.engine.request import Request, Status, TokenEvent, request_seed
from jaxserve.engine.sampling import TOP_LOGPROBS_MAX, LogitAdjust, Sampled, SamplingArrays, sampling_mode
from jaxserve.engine.structured import GrammarCompiler
from jaxserve.errors import JaxserveError, KVIntegrityError, OutOfPagesError, PageAllocatorError
from jaxserve.models.paged import DecodeBatch, PrefillBatch

Emit = Callable[[TokenEvent], None]


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
    text_sent: int = 0  # characters of `text` already streamed
    text: str = ""
    decoder: object = None  # tokenizer.StreamDecoder, when the engine has a tokenizer
    preemptions: int = 0
    pending: tuple[int, float, tuple] | None = None  # first token sampled by prefill, emitted after the hand-off
    slot: int = -1  # row of DecodeRows while decoding
    matcher: object = None  # llguidance.LLMatcher of a structured-output request (engine.structured)
    rank: int = 0  # data-parallel attention rank: its pages and batch rows live on that rank's devices

    @property
    def special(self) -> bool:
        """Needs more than the plain sampling programs: penalties/biases, a grammar or top logprobs."""
        p = self.req.params
        return p.adjusts_logits or self.matcher is not None or p.top_logprobs > 0

    @property
    def tokens(self) -> list[int]:
        return self.req.prompt + self.generated


@dataclass
class Stats:
    tag_mismatches: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    steps: int = 0
    overlapped: int = 0  # decode steps dispatched before the previous one was read


def dummy_prefill(b: int, t: int, m: int) -> tuple[PrefillBatch, SamplingArrays]:
    """An all-padding prefill batch of bucket shape (b rows, t tokens, m pages): for warm-up compiles."""
    z = jnp.zeros
    return (PrefillBatch(z((b, t), jnp.int32), z((b, t), jnp.int32), jnp.full((b, t), -1, jnp.int32),
                         z((b, m), jnp.int32), z((b,), jnp.int32), z((b,), jnp.int32), z((b, m), jnp.uint32),
                         z((b,), jnp.int32)), _samp_arrays([None] * b))


def dummy_decode(b: int, m: int) -> tuple[DecodeBatch, SamplingArrays]:
    z = jnp.zeros
    return (DecodeBatch(z((b,), jnp.int32), z((b,), jnp.int32), jnp.full((b,), -1, jnp.int32), z((b, m), jnp.int32),
                        z((b,), jnp.int32), z((b, m), jnp.uint32), z((b,), jnp.int32)), _samp_arrays([None] * b))


@dataclass(frozen=True)
class _Extras:
    """The optional parts of a batch's SamplingArrays (None / 0 when no row needs them)."""

    adjust: LogitAdjust | None = None
    mask: jax.Array | None = None
    top_n: int = 0


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _extras(seqs: list[Sequence | None], vocab: int, eos: set[int], grammar: GrammarCompiler | None) -> _Extras:
    """Penalty/bias arrays, grammar bitmasks and the top-logprobs width for a batch's rows (None = padding).
    Widths are padded to powers of two so the adjusting program compiles per bucket, not per request."""
    live = [s for s in seqs if s is not None]
    if not any(s.special for s in live):
        return _Extras()
    B = len(seqs)
    adjust = None
    bias_of = {}
    for i, s in enumerate(seqs):
        if s is None or not s.req.params.adjusts_logits:
            continue
        p = s.req.params
        pairs = list(p.logit_bias)
        if len(s.generated) < p.min_tokens and s.matcher is None:  # a grammar decides its own end
            pairs += [(t, -np.inf) for t in sorted(eos | set(p.stop_token_ids))]
        bias_of[i] = pairs
    if bias_of:
        L = _pow2(max(len(seqs[i].tokens) for i in bias_of))
        K = _pow2(max(max((len(v) for v in bias_of.values()), default=1), 1))
        history = np.full((B, L), -1, np.int32)
        prompt_len = np.zeros(B, np.int32)
        rep, freq, pres = np.ones(B, np.float32), np.zeros(B, np.float32), np.zeros(B, np.float32)
        bias_ids, bias = np.full((B, K), -1, np.int32), np.zeros((B, K), np.float32)
        for i, pairs in bias_of.items():
            s, p = seqs[i], seqs[i].req.params
            toks = s.tokens
            history[i, :len(toks)] = toks
            prompt_len[i] = len(s.req.prompt)
            rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
            if pairs:
                bias_ids[i, :len(pairs)] = [t for t, _ in pairs]
                bias[i, :len(pairs)] = [b for _, b in pairs]
        adjust = LogitAdjust(*jax.device_put((history, prompt_len, rep, freq, pres, bias_ids, bias)))
    mask = None
    if grammar is not None and any(s.matcher is not None for s in live):
        m = np.full((B, grammar.words), -1, np.int32)
        for i, s in enumerate(seqs):
            if s is not None and s.matcher is not None:
                m[i] = grammar.bitmask(s.matcher)
        mask = jax.device_put(m)
    top_n = min(TOP_LOGPROBS_MAX, vocab) if any(s.req.params.top_logprobs for s in live) else 0
    return _Extras(adjust, mask, top_n)


def _samp_arrays(seqs: list[Sequence | None], extras: _Extras = _Extras()) -> SamplingArrays:
    def col(f, dtype, empty=0):  # noqa: ANN001
        return np.array([f(s) if s is not None else empty for s in seqs], dtype)

    mode = sampling_mode((s.req.params.temperature, s.req.params.top_k, s.req.params.top_p) for s in seqs
                         if s is not None)
    # one device_put call for the five columns (JAX batches a pytree's transfers) instead of five
    temperature, top_k, top_p, seed, step = jax.device_put((
        col(lambda s: s.req.params.temperature, np.float32),
        col(lambda s: s.req.params.top_k, np.int32),
        col(lambda s: s.req.params.top_p, np.float32, 1.0),
        col(lambda s: request_seed(s.req), np.uint32),
        col(lambda s: len(s.generated), np.int32)))
    return SamplingArrays(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, step=step,
                          adjust=extras.adjust, mask=extras.mask, mode=mode, top_n=extras.top_n)


# packed decode upload: int32 columns, then the block table and expected tags (M each)
_COLS = ("tokens", "positions", "slots", "lengths", "num_pages", "temperature", "top_k", "top_p", "seed", "step",
         "src")


def _split_packed(packed: jax.Array, m: int) -> tuple[DecodeBatch, tuple[jax.Array, ...], jax.Array]:
    col = {name: packed[:, i] for i, name in enumerate(_COLS)}
    f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)  # noqa: E731
    u32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)  # noqa: E731
    n = len(_COLS)
    batch = DecodeBatch(col["tokens"], col["positions"], col["slots"], packed[:, n:n + m], col["lengths"],
                        u32(packed[:, n + m:n + 2 * m]), col["num_pages"])
    return batch, (f32(col["temperature"]), col["top_k"], f32(col["top_p"]), u32(col["seed"]), col["step"]), \
        col["src"]


@functools.partial(jax.jit, static_argnames=("m",))
def _unpack_decode(packed: jax.Array, m: int) -> tuple[DecodeBatch, tuple[jax.Array, ...]]:
    """packed [B, 11 + 2m] int32 (one host->device upload) -> (DecodeBatch, sampling columns) on device.

    Columns: _COLS (temperature and top_p are f32 bits, seed uint32 bits; src is read by `_unpack_decode_after`
    only), block table [m], expected tags [m] (uint32 bits)."""
    batch, cols, _ = _split_packed(packed, m)
    return batch, cols


@functools.partial(jax.jit, static_argnames=("m",))
def _unpack_decode_after(packed: jax.Array, prev_tokens: jax.Array, m: int
                         ) -> tuple[DecodeBatch, tuple[jax.Array, ...]]:
    """As `_unpack_decode`, for a batch dispatched while the previous decode is still running: a row whose src
    column is >= 0 takes prev_tokens[src] (prev_tokens [B_prev] int32, that decode's sampled tokens, still on the
    device) as its input token; src -1 keeps the packed token (a row that joined since)."""
    batch, cols, src = _split_packed(packed, m)
    prev = prev_tokens[jnp.clip(src, 0, prev_tokens.shape[0] - 1)]
    return dataclasses.replace(batch, tokens=jnp.where(src >= 0, prev, batch.tokens)), cols


def compile_unpack(rows: jax.sharding.Sharding, b: int, m: int) -> None:
    """Run `_unpack_decode` and `_unpack_decode_after` once on zeros of b rows and m pages placed on `rows` (where
    decode batches live), so a first request's decode steps compile neither."""
    packed = jax.device_put(np.zeros((b, len(_COLS) + 2 * m), np.int32), rows)
    _unpack_decode(packed, m)
    _unpack_decode_after(packed, jax.device_put(np.zeros((b,), np.int32), rows), m)


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


class DecodeRows:
    """Persistent host arrays of the decoding sequences, one row (slot) each, updated in place: the decode batch
    is gathered from them with numpy indexing (no per-row Python) and uploaded as one packed int32 array
    (`_unpack_decode` splits it on device; one upload instead of twelve).

    tables/tags [R, max_pages] int32/uint32 (the sequence's decode pages and their tags), num_pages [R],
    length [R] (tokens in the decode pool), last [R] (last sampled token), step [R] (tokens generated),
    temperature/top_p [R] f32, top_k [R] int32, seed [R] uint32.
    """

    def __init__(self, rows: int, max_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.tables = np.zeros((rows, max_pages), np.int32)
        self.tags = np.zeros((rows, max_pages), np.uint32)
        self.num_pages = np.zeros(rows, np.int32)
        self.length = np.zeros(rows, np.int32)
        self.last = np.zeros(rows, np.int32)
        self.step = np.zeros(rows, np.int32)
        self.temperature = np.zeros(rows, np.float32)
        self.top_p = np.ones(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.seed = np.zeros(rows, np.uint32)
        self.special = np.zeros(rows, np.bool_)  # the row needs _extras (penalties, grammar, top logprobs)
        self._free = list(range(rows - 1, -1, -1))

    def assign(self, seq: Sequence) -> None:
        """Give a sequence entering decode a row, filled from its state."""
        slot = self._free.pop()
        seq.slot = slot
        p = seq.req.params
        n = len(seq.decode_pages)
        self.tables[slot] = 0
        self.tags[slot] = 0
        self.tables[slot, :n] = [pg for pg, _ in seq.decode_pages]
        self.tags[slot, :n] = [t for _, t in seq.decode_pages]
        self.num_pages[slot] = n
        self.length[slot] = seq.decode_len
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = p.temperature, p.top_k, p.top_p
        self.seed[slot] = request_seed(seq.req)
        self.special[slot] = seq.special

    def accepted(self, seq: Sequence) -> None:
        """Mirror a token accepted outside a decode step (the prefill's first token)."""
        if seq.slot >= 0:
            self.last[seq.slot] = seq.generated[-1]
            self.step[seq.slot] = len(seq.generated)

    def add_page(self, seq: Sequence, page: int, tag: int) -> None:
        n = self.num_pages[seq.slot]
        self.tables[seq.slot, n], self.tags[seq.slot, n] = page, tag
        self.num_pages[seq.slot] = n + 1

    def release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self._free.append(seq.slot)
            seq.slot = -1

    def packed(self, idx: np.ndarray, b: int, m: int, ahead: np.ndarray | None = None,
               src: np.ndarray | None = None) -> np.ndarray:
        """The decode batch of rows `idx` [n] padded to b rows and m pages: [b, 11 + 2m] int32 (see _unpack_decode).
        Padding rows: slot -1, lengths 0, null pages, tags 0, greedy, src -1.

        ahead [n] int32 (0/1): 1 for a row already in the decode in flight, whose host state is one token behind:
        position and seed step one further. src [n] int32: that row's batch row in the decode in flight, -1 for
        the host's last token (`_unpack_decode_after`)."""
        # a fresh buffer each step: on CPU the upload may alias host memory, so a reused one could change under
        # an array still in flight
        buf = np.zeros((b, len(_COLS) + 2 * m), np.int32)
        n, ps, c = len(idx), self.page_size, len(_COLS)
        ahead = np.zeros(n, np.int32) if ahead is None else ahead
        buf[n:, 2] = -1
        buf[n:, 7] = np.float32(1.0).view(np.int32)
        buf[:, 10] = -1
        if src is not None:
            buf[:n, 10] = src
        pos = self.length[idx] + ahead
        tables = self.tables[idx, :m]
        page = np.take_along_axis(tables, (pos // ps)[:, None], axis=1)[:, 0]
        buf[:n, 0] = self.last[idx]
        buf[:n, 1] = pos
        buf[:n, 2] = page * ps + pos % ps
        buf[:n, 3] = pos + 1
        buf[:n, 4] = self.num_pages[idx]
        buf[:n, 5] = self.temperature[idx].view(np.int32)
        buf[:n, 6] = self.top_k[idx]
        buf[:n, 7] = self.top_p[idx].view(np.int32)
        buf[:n, 8] = self.seed[idx].view(np.int32)
        buf[:n, 9] = self.step[idx] + ahead
        buf[:n, c:c + m] = tables
        buf[:n, c + m:] = self.tags[idx, :m].view(np.int32)
        return buf


class Scheduler:
    def __init__(self, programs: Programs, model_cfg: ModelConfig, cfg: EngineConfig, emit: Emit,
                 tokenizer: object | None = None, grammar: GrammarCompiler | None = None) -> None:
        self.programs = programs
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.emit = emit
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.ranks = cfg.dp_ranks
        self.prefill_alloc = PageAllocator(cfg.num_prefill_pages, shards=self.ranks)
        self.decode_alloc = PageAllocator(cfg.num_decode_pages, shards=self.ranks)
        self.rows = DecodeRows(cfg.max_batch, cfg.max_pages_per_seq, cfg.page_size)
        # one prefix cache per DP attention rank: a cached page is only readable on its own rank's devices
        salt = engine_salt(model_cfg, cfg.prefill_weights, programs.layouts.prefill.dtype, cfg.dtype)
        self.prefix_caches = [PrefixCache(self.prefill_alloc, cfg.page_size, salt) for _ in range(self.ranks)] \
            if cfg.prefix_cache else []
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # prefilling or decoding, in admission order
        self.stats = Stats()
        self._order = 0
        self._inbox: list[Sequence] = []
        self._aborts: set[str] = set()
        self._inflight: _InFlight | None = None  # the decode dispatched but not read yet (overlap)
        self._lock = threading.Lock()
        self.eos = set(model_cfg.eos_token_ids)
        if tokenizer is not None:
            self.eos |= set(getattr(tokenizer, "eos_token_ids", ()) or ())

    # ---- cross-thread entry points ------------------------------------------------------------------------
    def submit(self, req: Request, decoder: object | None = None, matcher: object | None = None) -> None:
        """Queue a validated request; `decoder` streams its text (a tokenizer.StreamDecoder) when given; `matcher`
        constrains it to a grammar (engine.structured)."""
        with self._lock:
            self._inbox.append(Sequence(req, order=-1, decoder=decoder, matcher=matcher))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def pending(self) -> int:
        with self._lock:
            return len(self._inbox)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts or self.waiting or self.running)

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> None:
        """One scheduling iteration: intake, aborts, admission, a prefill batch, hand-offs, a decode batch (with
        overlap: the next decode is dispatched, then the one dispatched last step is read)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, set()
        for seq in inbox:
            seq.order = self._order
            self._order += 1
            self.waiting.append(seq)
        for rid in aborts:
            self._abort(rid)
        self._admit()
        self._prefill_step()
        self._decode_step()
        self.stats.steps += 1

    def _abort(self, rid: str) -> None:
        for seq in list(self.waiting) + self.running:
            if seq.req.request_id == rid:
                self._finish(seq, "abort")
                self.stats.aborted += 1

    # ---- admission ----------------------------------------------------------------------------------------
    def _pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.cfg.page_size)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache (rank 0's under DP attention)."""
        return self.prefix_caches[0] if self.prefix_caches else None

    def _rank_load(self, rank: int) -> int:
        return sum(1 for s in self.running if s.rank == rank)

    def _pick_rank(self, tokens: list[int], cache_salt: str | None = None) -> int | None:
        """The DP attention rank for a new sequence: among ranks with room for it (decode pages, rows), the one
        whose prefix cache holds most of its prompt, then the least loaded. None: no rank has room."""
        need = self._pages_for(len(tokens) + 1)
        if self.ranks == 1:
            return 0 if self.decode_alloc.num_free >= need else None
        per_rank_rows = self.cfg.max_batch // self.ranks
        best, key = None, None
        for r in range(self.ranks):
            load = self._rank_load(r)
            if self.decode_alloc.num_free_in(r) < need or load >= per_rank_rows:
                continue
            hit = self.prefix_caches[r].match(tokens, cache_salt) if self.prefix_caches else 0
            k = (-hit, load, r)
            if key is None or k < key:
                best, key = r, k
        return best

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
        tokens = seq.tokens
        rank = self._pick_rank(tokens, seq.req.cache_salt)
        if rank is None:
            return False  # FCFS: nobody overtakes a request that waits for decode pages
        cache = self.prefix_caches[rank] if self.prefix_caches else None
        cached = cache.lookup(tokens, seq.req.cache_salt) if cache else []
        need = self._pages_for(len(tokens)) - len(cached)
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

    def _rank_rows(self, ranks: list[int], buckets: list[int]) -> tuple[int, list[int]]:
        """Batch layout under DP attention: rank r's rows fill rows [r * b, (r + 1) * b) of a B = ranks * b batch
        (the batch axis is split over the ranks). -> (B, batch row of each item, in order)."""
        if self.ranks == 1:
            return self.cfg.pick(buckets, len(ranks)), list(range(len(ranks)))
        counts = np.bincount(np.asarray(ranks, np.int64), minlength=self.ranks)
        B = self.cfg.pick(buckets, self.ranks * int(counts.max()))
        b, used, out = B // self.ranks, [0] * self.ranks, []
        for r in ranks:
            out.append(r * b + used[r])
            used[r] += 1
        return B, out

    # ---- prefill ------------------------------------------------------------------------------------------
    def _prefill_step(self) -> None:
        cfg, ps = self.cfg, self.cfg.page_size
        budget = cfg.max_prefill_tokens
        rows: list[tuple[Sequence, int, int]] = []  # (seq, start, n)
        widest = 0
        for seq in self.running:
            if seq.status is not Status.PREFILLING or seq.computed >= seq.target or budget <= 0:
                continue
            n = min(cfg.prefill_chunk, seq.target - seq.computed, budget)
            b, _ = self._rank_rows([s.rank for s, _, _ in rows] + [seq.rank], cfg.row_buckets)
            slots = b * cfg.pick(cfg.chunk_buckets, max(widest, n))
            if rows and slots > cfg.prefill_slots:
                break  # padded rows x chunk would exceed the step's token slots (see EngineConfig.prefill_shapes)
            rows.append((seq, seq.computed, n))
            widest = max(widest, n)
            budget -= n
        if rows:
            B, place = self._rank_rows([s.rank for s, _, _ in rows], cfg.row_buckets)
            T = cfg.pick(cfg.chunk_buckets, widest)
            M = cfg.pick(cfg.prefill_page_buckets, max(self._pages_for(s + n) for _, s, n in rows))
            tokens = np.zeros((B, T), np.int32)
            positions = np.zeros((B, T), np.int32)
            slots = np.full((B, T), -1, np.int32)
            tables = np.full((B, M), NULL_PAGE, np.int32)
            tags = np.zeros((B, M), np.uint32)
            ctx = np.zeros(B, np.int32)
            chunk = np.zeros(B, np.int32)
            used_pages = np.zeros(B, np.int32)
            for i, (seq, start, n) in zip(place, rows):
                toks = seq.tokens
                pos = np.arange(start, start + n)
                pages = np.array([p for p, _ in seq.prefill_pages], np.int32)
                tokens[i, :n] = toks[start:start + n]
                positions[i, :n] = pos
                slots[i, :n] = pages[pos // ps] * ps + pos % ps
                used = self._pages_for(start + n)
                tables[i, :used] = pages[:used]
                tags[i, :used] = [t for _, t in seq.prefill_pages[:used]]
                ctx[i], chunk[i], used_pages[i] = start + n, n, used
            batch = PrefillBatch(*jax.device_put((tokens, positions, slots, tables, ctx, chunk, tags, used_pages)))
            by_row: list[Sequence | None] = [None] * B
            for i, (seq, _, _) in zip(place, rows):
                by_row[i] = seq
            self.programs.sync_tags(self.prefill_alloc, self.decode_alloc)
            out, ok = self.programs.run_prefill(batch, _samp_arrays(by_row, self._extras(by_row)))
            for i, (seq, start, n) in zip(place, rows):
                if not ok[i]:  # its context (prefix-cache pages included) no longer holds its tags: it read nothing
                    self._fail(seq, self._integrity_error(seq, "prefill"))
                    continue
                seq.computed = start + n
                if seq.computed == seq.target:
                    self._guarded(seq, self._complete_prefill, seq, int(out.tokens[i]), float(out.logprobs[i]),
                                  _top(out, i, seq))
        # every prefilled sequence moves to the decode pool together (retried each step while that pool is full)
        self._handoffs([s for s in self.running if s.status is Status.PREFILLING and s.computed == s.target
                        and not s.decode_pages])

    def _extras(self, seqs: list[Sequence | None]) -> _Extras:
        return _extras(seqs, self.model_cfg.vocab_size, self.eos, self.grammar)

    def _complete_prefill(self, seq: Sequence, token: int, logprob: float, top: tuple = ()) -> None:
        if self.prefix_caches:
            self.prefix_caches[seq.rank].insert(seq.tokens[: seq.target], seq.prefill_pages, seq.req.cache_salt)
        seq.pending = (token, logprob, top)  # the first token; emitted once the hand-off is done

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
            if a and self._at_length_limit(seq, pending=1):
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
        B, place = self._rank_rows([s.rank for s in ready], cfg.row_buckets)
        idx = np.fromiter((s.slot for s in ready), np.int64, n)
        M = cfg.pick(cfg.page_buckets, int(self.rows.num_pages[idx].max()))
        self.programs.sync_tags(self.prefill_alloc, self.decode_alloc)
        if self.ranks == 1:
            packed = self.rows.packed(idx, B, M, ahead, src)
        else:
            ranks = np.fromiter((s.rank for s in ready), np.int64, n)
            packed = np.concatenate([self.rows.packed(idx[ranks == r], B // self.ranks, M)
                                     for r in range(self.ranks)])
        packed = jax.device_put(packed, self.programs.decode_rows)  # one upload for the whole batch
        if prev is None:
            batch, cols = _unpack_decode(packed, M)
        else:
            batch, cols = _unpack_decode_after(packed, prev.pending[0].tokens, M)
        mode = sampling_mode(zip(self.rows.temperature[idx].tolist(), self.rows.top_k[idx].tolist(),
                                 self.rows.top_p[idx].tolist()))
        by_row: list[Sequence | None] = [None] * B
        for i, seq in zip(place, ready):
            by_row[i] = seq
        extras = self._extras(by_row) if self.rows.special[idx].any() else _Extras()
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
        rows = self.rows
        rows.length[slots[good]] += 1
        rows.last[slots] = out.tokens[at]
        rows.step[slots] += 1
        for (seq, _, i), tok, lp, fine in zip(keep, out.tokens[at].tolist(), out.logprobs[at].tolist(),
                                              good.tolist()):
            if not fine:
                self._fail(seq, self._integrity_error(seq, "decode"))
                continue
            seq.decode_len += 1
            self._accept(seq, tok, lp, _top(out, i, seq) if flight.top_n else ())

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
        p = seq.req.params
        seq.generated.append(token)
        seq.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        reason = None
        if not p.ignore_eos and token in self.eos or token in p.stop_token_ids:
            reason = "stop"
        # the grammar is complete and allows nothing more: this token's text is kept, then the request stops
        done = seq.matcher is not None and reason is None and seq.matcher.consume_token(token) \
            and seq.matcher.is_stopped()
        delta = ""
        if seq.decoder is not None and reason is None:
            seq.text += seq.decoder.push(token)
            cut = _find_stop(seq.text, p.stop)
            if cut is not None:
                seq.text = seq.text[:cut]
                reason = "stop"
            if done and reason is None:
                reason = "stop"
            hold = 0 if reason else max((len(s) - 1 for s in p.stop), default=0)
            end = max(seq.text_sent, len(seq.text) - hold)
            delta, seq.text_sent = seq.text[seq.text_sent:end], end
        if done and reason is None:
            reason = "stop"
        if reason is None and self._at_length_limit(seq):
            reason = "length"
        if reason is not None and seq.decoder is not None and reason != "stop":
            seq.text += seq.decoder.flush()
        if reason is not None and seq.decoder is not None:
            delta += seq.text[seq.text_sent:]
            seq.text_sent = len(seq.text)
        self.emit(TokenEvent(seq.req.request_id, token_id=token, logprob=logprob, text=delta, top_logprobs=top))
        if reason is not None:
            self._finish(seq, reason)

    def _at_length_limit(self, seq: Sequence, pending: int = 0) -> bool:
        """seq ends by length (max_tokens, or the context window) once its accepted tokens plus `pending` tokens
        read but not accepted yet are in (`_accept` after a token; the overlap's look-ahead with pending=1)."""
        return len(seq.generated) + pending >= seq.req.params.max_tokens or \
            seq.decode_len + pending + 1 >= self.cfg.max_model_len

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
                             completion_tokens=len(seq.generated)))


def _top(out: Sampled, i: int, seq: Sequence) -> tuple[tuple[int, float], ...]:
    """Row i's requested top alternatives: ((token id, logprob), ...), most likely first."""
    k = seq.req.params.top_logprobs
    return tuple(zip(out.top_ids[i, :k].tolist(), out.top_logprobs[i, :k].tolist()))


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
