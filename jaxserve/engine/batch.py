"""The host->device batch formats of the scheduler's steps, and the device code that unpacks them.

Decode: `DecodeRows` keeps one host row (slot) per decoding sequence, updated in place; a step's batch is gathered
from it with numpy indexing and uploaded as one packed [B, 11 + 2m] int32 array (`DecodeRows.packed`), which the
jitted `unpack_decode` / `unpack_decode_after` split on the device into a `DecodeBatch` and its sampling columns.
Prefill: `prefill_batch` builds a step's chunks as a `PrefillBatch` (one upload). Sampling: `sampling_arrays` gives
a batch's per-row sampling columns, `sampling_extras` the optional penalty / bias arrays, allowed-token bitmasks
and top logprobs width of rows that need them (host arrays, uploaded by `sampling_forms`). `dummy_prefill` / `dummy_decode` are all-padding batches of a bucket's
shape, for compiling programs ahead of use.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache import NULL_PAGE
from jaxserve.engine.request import request_seed
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.sampling import TOP_LOGPROBS_MAX, LogitAdjust, SamplingArrays, SamplingMode, sampling_mode
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.structured import GrammarCompiler
from jaxserve.models.paged import DecodeBatch, PrefillBatch


def dummy_prefill(b: int, t: int, m: int) -> tuple[PrefillBatch, SamplingArrays]:
    """An all-padding prefill batch of bucket shape (b rows, t tokens, m pages): for warm-up compiles."""
    z = jnp.zeros
    return (PrefillBatch(z((b, t), jnp.int32), z((b, t), jnp.int32), jnp.full((b, t), -1, jnp.int32),
                         z((b, m), jnp.int32), z((b,), jnp.int32), z((b,), jnp.int32), z((b, m), jnp.uint32),
                         z((b,), jnp.int32)), sampling_arrays([None] * b))


def dummy_decode(b: int, m: int) -> tuple[DecodeBatch, SamplingArrays]:
    """An all-padding decode batch of bucket shape (b rows, m pages): for warm-up compiles."""
    z = jnp.zeros
    return (DecodeBatch(z((b,), jnp.int32), z((b,), jnp.int32), jnp.full((b,), -1, jnp.int32), z((b, m), jnp.int32),
                        z((b,), jnp.int32), z((b, m), jnp.uint32), z((b,), jnp.int32)), sampling_arrays([None] * b))


@dataclass(frozen=True)
class SamplingExtras:
    """The optional parts of a batch's SamplingArrays as host arrays (None / 0 when no row needs them);
    `sampling_forms.SamplingForms` pads them to its fixed widths and uploads them."""

    adjust: LogitAdjust | None = None
    mask: np.ndarray | None = None
    top_n: int = 0


def _penalized(s: Sequence | None) -> bool:
    """The row has a penalty or a logit_bias (its LogitAdjust row is not neutral)."""
    p = None if s is None else s.req.params
    return p is not None and bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                                  or p.logit_bias)


def sampling_extras(seqs: list[Sequence | None], vocab: int, eos: set[int], grammar: GrammarCompiler | None
                    ) -> SamplingExtras:
    """Penalty/bias arrays, allowed-token bitmasks (a grammar's; a one-token mask for a row whose next token is
    forced, see engine.budget; every token but the end tokens while min_tokens is not reached) and the
    top-logprobs width for a batch's rows (None = padding), as host arrays at the widths these rows need."""
    live = [s for s in seqs if s is not None]
    if not any(s.special for s in live):
        return SamplingExtras()
    return SamplingExtras(_adjust(seqs), _mask(seqs, vocab, eos, grammar), top_width(live, vocab))


def top_width(live: list[Sequence], vocab: int) -> int:
    """The top-logprobs width a batch's live rows need: TOP_LOGPROBS_MAX (at most the vocabulary) when one asks."""
    return min(TOP_LOGPROBS_MAX, vocab) if any(s.req.params.top_logprobs for s in live) else 0


def _adjust(seqs: list[Sequence | None]) -> LogitAdjust | None:
    """The rows' penalties and biases (neutral for rows without), None when no row has any."""
    rows = [i for i, s in enumerate(seqs) if _penalized(s)]
    if not rows:
        return None
    B, L = len(seqs), max(len(seqs[i].tokens) for i in rows)
    K = max(max(len(seqs[i].req.params.logit_bias) for i in rows), 1)
    history = np.full((B, L), -1, np.int32)
    prompt_len = np.zeros(B, np.int32)
    rep, freq, pres = np.ones(B, np.float32), np.zeros(B, np.float32), np.zeros(B, np.float32)
    bias_ids, bias = np.full((B, K), -1, np.int32), np.zeros((B, K), np.float32)
    for i in rows:
        s, p = seqs[i], seqs[i].req.params
        toks = s.tokens
        history[i, :len(toks)] = toks
        prompt_len[i] = len(s.req.prompt)
        rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        if p.logit_bias:
            bias_ids[i, :len(p.logit_bias)] = [t for t, _ in p.logit_bias]
            bias[i, :len(p.logit_bias)] = [b for _, b in p.logit_bias]
    return LogitAdjust(history, prompt_len, rep, freq, pres, bias_ids, bias)


def _mask(seqs: list[Sequence | None], vocab: int, eos: set[int], grammar: GrammarCompiler | None
          ) -> np.ndarray | None:
    """The rows' allowed-token bitmasks [B, ceil(vocab / 32)] int32 (all ones for free rows), None when no row is
    constrained."""
    forced = {i: t for i, s in enumerate(seqs) if s is not None and (t := s.forced_token()) is not None}
    ending = {i for i, s in enumerate(seqs) if s is not None and s.matcher is None  # a grammar decides its end
              and len(s.generated) < s.req.params.min_tokens}
    grammars = grammar is not None and any(s is not None and s.matcher is not None for s in seqs)
    if not (forced or ending or grammars):
        return None
    m = np.full((len(seqs), (vocab + 31) // 32), -1, np.int32)
    bits = m.view(np.uint32)
    for i, s in enumerate(seqs):
        if i in forced:  # a spent thinking budget's end token: the only one allowed (instead of any grammar's)
            m[i] = 0
            bits[i, forced[i] // 32] = np.uint32(1 << (forced[i] % 32))
        elif s is not None and s.matcher is not None:
            m[i] = grammar.bitmask(s.matcher)
        elif i in ending:  # min_tokens not reached: no end token
            for t in sorted(eos | set(s.req.params.stop_token_ids)):
                if 0 <= t < vocab:
                    bits[i, t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return m


def sampling_columns(seqs: list[Sequence | None]) -> tuple[np.ndarray, ...]:
    """The per-row sampling columns of a batch's rows (None = padding: greedy, top_p 1) as host arrays:
    (temperature f32, top_k int32, top_p f32, seed uint32, step int32), each [B]."""
    def col(f, dtype, empty=0):  # noqa: ANN001
        return np.array([f(s) if s is not None else empty for s in seqs], dtype)

    return (col(lambda s: s.req.params.temperature, np.float32), col(lambda s: s.req.params.top_k, np.int32),
            col(lambda s: s.req.params.top_p, np.float32, 1.0), col(lambda s: request_seed(s.req), np.uint32),
            col(lambda s: len(s.generated), np.int32))


def sampling_arrays(seqs: list[Sequence | None], extras: SamplingExtras = SamplingExtras(),
                    columns: tuple[jax.Array, ...] | None = None) -> SamplingArrays:
    """The sampling columns of a batch's rows on the device (`sampling_columns`, uploaded; or `columns`, already
    on the device: e.g. unpacked from a verify's one upload), with `extras` (host arrays:
    `sampling_forms.SamplingForms` uploads them in its fixed widths)."""
    mode = sampling_mode((s.req.params.temperature, s.req.params.top_k, s.req.params.top_p) for s in seqs
                         if s is not None)
    # one device_put call for the five columns (JAX batches a pytree's transfers) instead of five
    temperature, top_k, top_p, seed, step = jax.device_put(sampling_columns(seqs)) if columns is None else columns
    return SamplingArrays(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, step=step,
                          adjust=extras.adjust, mask=extras.mask, mode=mode, top_n=extras.top_n)


def rank_rows(ranks: list[int], n_ranks: int, buckets: list[int]) -> tuple[int, list[int]]:
    """Batch layout of items on DP attention ranks `ranks` (one each): rank r's rows fill rows [r * b, (r + 1) * b)
    of a B = n_ranks * b batch (the batch axis is split over the ranks), B a bucket of `buckets`.
    -> (B, batch row of each item, in order)."""
    if n_ranks == 1:
        return EngineConfig.pick(buckets, len(ranks)), list(range(len(ranks)))
    counts = np.bincount(np.asarray(ranks, np.int64), minlength=n_ranks)
    B = EngineConfig.pick(buckets, n_ranks * int(counts.max()))
    b, used, out = B // n_ranks, [0] * n_ranks, []
    for r in ranks:
        out.append(r * b + used[r])
        used[r] += 1
    return B, out


def padding_prefill(b: int, t: int, m: int) -> PrefillBatch:
    """A prefill-shaped batch of b rows, t tokens, m pages as host (numpy) arrays, all padding (slots -1, null pages,
    zeros), for a builder to fill in place."""
    return PrefillBatch(np.zeros((b, t), np.int32), np.zeros((b, t), np.int32), np.full((b, t), -1, np.int32),
                        np.full((b, m), NULL_PAGE, np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32),
                        np.zeros((b, m), np.uint32), np.zeros(b, np.int32))


def prefill_batch(rows: list[tuple[Sequence, int, int]], place: list[int], b: int, t: int, m: int,
                  page_size: int) -> PrefillBatch:
    """The prefill chunks rows[j] = (sequence, start, n) (tokens [start, start + n) of its `tokens`) at batch rows
    place[j], padded to b rows of t tokens and m pages, on the device (one upload). Padding: slot -1, null pages."""
    ps = page_size
    x = padding_prefill(b, t, m)
    for i, (seq, start, n) in zip(place, rows):
        toks = seq.tokens
        pos = np.arange(start, start + n)
        pages = np.array([p for p, _ in seq.prefill_pages], np.int32)
        x.tokens[i, :n] = toks[start:start + n]
        x.positions[i, :n] = pos
        x.slots[i, :n] = pages[pos // ps] * ps + pos % ps
        used = -(-(start + n) // ps)
        x.block_tables[i, :used] = pages[:used]
        x.expected_tags[i, :used] = [tag for _, tag in seq.prefill_pages[:used]]
        x.ctx_lens[i], x.chunk_lens[i], x.num_pages[i] = start + n, n, used
    return jax.device_put(x)


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
def unpack_decode(packed: jax.Array, m: int) -> tuple[DecodeBatch, tuple[jax.Array, ...]]:
    """packed [B, 11 + 2m] int32 (one host->device upload) -> (DecodeBatch, sampling columns) on device.

    Columns: _COLS (temperature and top_p are f32 bits, seed uint32 bits; src is read by `unpack_decode_after`
    only), block table [m], expected tags [m] (uint32 bits)."""
    batch, cols, _ = _split_packed(packed, m)
    return batch, cols


@functools.partial(jax.jit, static_argnames=("m",))
def unpack_decode_after(packed: jax.Array, prev_tokens: jax.Array, m: int
                        ) -> tuple[DecodeBatch, tuple[jax.Array, ...]]:
    """As `unpack_decode`, for a batch dispatched while the previous decode is still running: a row whose src
    column is >= 0 takes prev_tokens[src] (prev_tokens [B_prev] int32, that decode's sampled tokens, still on the
    device) as its input token; src -1 keeps the packed token (a row that joined since)."""
    batch, cols, src = _split_packed(packed, m)
    prev = prev_tokens[jnp.clip(src, 0, prev_tokens.shape[0] - 1)]
    return dataclasses.replace(batch, tokens=jnp.where(src >= 0, prev, batch.tokens)), cols


def compile_unpack(rows: jax.sharding.Sharding, b: int, m: int, prevs: tuple[int, ...] | None = None) -> None:
    """Run `unpack_decode` and `unpack_decode_after` once on zeros of b rows and m pages placed on `rows` (where
    decode batches live), so a first request's decode steps compile neither. prevs: the row counts of the
    overlapped decode before it to cover (default: b)."""
    packed = jax.device_put(np.zeros((b, len(_COLS) + 2 * m), np.int32), rows)
    unpack_decode(packed, m)
    for prev in prevs or (b,):
        unpack_decode_after(packed, jax.device_put(np.zeros((prev,), np.int32), rows), m)


class DecodeRows:
    """Persistent host arrays of the decoding sequences, one row (slot) each, updated in place: the decode batch
    is gathered from them with numpy indexing (no per-row Python) and uploaded as one packed int32 array
    (`unpack_decode` splits it on device; one upload instead of twelve).

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
        self.special = np.zeros(rows, np.bool_)  # the row needs sampling_extras (penalties, grammar, top logprobs)
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

    def advance(self, slots: np.ndarray, tokens: np.ndarray, ok: np.ndarray) -> None:
        """Mirror a decode step read back: rows `slots` [n] sampled `tokens` [n] int32; ok [n] bool: the row's
        tag check passed, so its input token's KV is now in the pool."""
        self.length[slots[ok]] += 1
        self.last[slots] = tokens
        self.step[slots] += 1

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
        """The decode batch of rows `idx` [n] padded to b rows and m pages: [b, 11 + 2m] int32 (see unpack_decode).
        Padding rows: slot -1, lengths 0, null pages, tags 0, greedy, src -1.

        ahead [n] int32 (0/1): 1 for a row already in the decode in flight, whose host state is one token behind:
        position and seed step one further. src [n] int32: that row's batch row in the decode in flight, -1 for
        the host's last token (`unpack_decode_after`)."""
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

    def upload(self, idx: np.ndarray, ranks: np.ndarray, n_ranks: int, b: int, m: int,
               sharding: jax.sharding.Sharding, ahead: np.ndarray | None = None, src: np.ndarray | None = None,
               prev_tokens: jax.Array | None = None) -> tuple[DecodeBatch, tuple[jax.Array, ...]]:
        """The decode batch of rows `idx` [n] (on DP attention ranks `ranks` [n] of n_ranks, see `rank_rows`),
        padded to b rows and m pages, uploaded to `sharding` as one packed array and unpacked on the device ->
        (DecodeBatch, sampling columns). ahead / src: see `packed` (one rank only); prev_tokens [B_prev] int32: the
        sampled tokens of the decode in flight, for `unpack_decode_after` (None: `unpack_decode`)."""
        if n_ranks == 1:
            packed = self.packed(idx, b, m, ahead, src)
        else:
            packed = np.concatenate([self.packed(idx[ranks == r], b // n_ranks, m) for r in range(n_ranks)])
        packed = jax.device_put(packed, sharding)  # one upload for the whole batch
        if prev_tokens is None:
            return unpack_decode(packed, m)
        return unpack_decode_after(packed, prev_tokens, m)

    def sampling_mode(self, idx: np.ndarray) -> SamplingMode:
        """The sampling program rows `idx` need (`sampling.sampling_mode`)."""
        return sampling_mode(zip(self.temperature[idx].tolist(), self.top_k[idx].tolist(), self.top_p[idx].tolist()))
