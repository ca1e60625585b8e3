"""The device side of chained n-gram verify steps (`engine.speculative`'s overlap): the next verify's batch, drafts
and sampling columns made on the device from the verify in flight, so the host dispatches verify N + 1 before it
reads verify N (as the plain decode path dispatches decode N + 1 before reading N).

Each chained row carries its token history on the device (prompt + output, `hist` [B, H] int32, `state` [B, 4]
int32: decode length, history length, tokens generated, max_tokens). `chain_inputs` appends verify N's emitted
tokens, looks the drafts up as `ngram.ngram_drafts` does (`device_ngram`: the same tokens), cuts them to the
row's room (max_tokens, the context window, the pages the host gave it) and lays out verify N + 1's positions and
slots; it also packs N's results into one int32 array, so reading N is one device -> host copy.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine.batch import sampling_columns
from jaxserve.engine.config import EngineConfig
from jaxserve.models.paged import PrefillBatch

STATE = 4  # columns of `state`: decode length, history length, tokens generated, max_tokens


def chains(cfg: EngineConfig, decode_rows: jax.sharding.Sharding) -> bool:
    """Whether n-gram verifies may chain on the device: n-gram drafts, overlap on, decode batches on one device
    (`chain_inputs` makes the next verify's inputs there). The warm-up plan compiles `chain_inputs` where this holds
    and `engine.speculative` chains only where it does."""
    return cfg.speculative is not None and cfg.speculative.method == "ngram" and cfg.overlap and \
        len(decode_rows.device_set) == 1


def device_ngram(hist: jax.Array, length: jax.Array, k: int, n_max: int = 3) -> tuple[jax.Array, jax.Array]:
    """hist [B, H] int32 (row b's tokens in [:length[b]]), length [B] int32 -> (drafts [B, k] int32, found [B]
    bool): `ngram.ngram_drafts(hist[b, :length[b]], k, n_max)` per row (found False: no n-gram recurs)."""
    B, H = hist.shape
    at = jnp.arange(H)[None, :]
    padded = jnp.pad(hist, ((0, 0), (0, n_max)))
    found, start, size = jnp.zeros(B, bool), jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32)
    for n in range(n_max, 0, -1):  # longer contexts first
        suffix = jnp.take_along_axis(hist, jnp.clip(length[:, None] - n + jnp.arange(n)[None, :], 0, H - 1), 1)
        match = functools.reduce(jnp.logical_and, [padded[:, j:j + H] == suffix[:, j:j + 1] for j in range(n)])
        match &= (at <= (length - 1 - n)[:, None]) & (n <= length - 1)[:, None]  # windows over hist[:length - 1]
        last = jnp.max(jnp.where(match, at, -1), axis=1)
        take = ~found & (last >= 0)
        found, start, size = found | take, jnp.where(take, last, start), jnp.where(take, n, size)
    period = jnp.maximum(length - start - size, 1)  # the copy runs on cyclically into the drafts themselves
    idx = start[:, None] + size[:, None] + jnp.arange(k)[None, :] % period[:, None]
    return jnp.take_along_axis(hist, jnp.clip(idx, 0, H - 1), 1), found


@functools.partial(jax.jit, static_argnames=("page_size", "max_model_len"))
def chain_inputs(tokens: jax.Array, count: jax.Array, logprobs: jax.Array, ok: jax.Array, ndrafts: jax.Array,
                 state: jax.Array, hist: jax.Array, columns: tuple[jax.Array, ...], host: jax.Array, *,
                 page_size: int, max_model_len: int) -> tuple:
    """Verify N's outputs (tokens [B, K + 1] int32, count [B] int32, logprobs [B, K + 1] f32, ok [B] bool; ndrafts
    [B] int32: its drafts per row), its rows' state [B, STATE] and hist [B, H], its sampling columns (temperature,
    top_k, top_p, seed, step; each [B]), and host [B, 2 + 2m] int32 (`chain_host`: alive, num_pages, block table,
    tag bits, for N + 1) -> (PrefillBatch, drafts [B, K] int32 (-1 past a row's own), columns, state, hist, ndrafts
    [B] int32: all for N + 1; N's results packed [B, 2(K + 1) + 3] int32: tokens, logprob bits, count, ok, ndrafts).
    A row not alive is padding in N + 1 (it writes nothing)."""
    B, K1 = tokens.shape
    H, m, ps = hist.shape[1], (host.shape[1] - 2) // 2, page_size
    alive, pages, table = host[:, 0] > 0, host[:, 1], host[:, 2:2 + m]
    tags = jax.lax.bitcast_convert_type(host[:, 2 + m:], jnp.uint32)
    start, hlen, gen, max_tokens = (state[:, i] for i in range(STATE))
    j = jnp.arange(K1)[None, :]
    where = jnp.where(j < count[:, None], hlen[:, None] + j, H)  # N's emitted tokens go after the history
    hist = hist.at[jnp.arange(B)[:, None], where].set(tokens, mode="drop")
    start, hlen, gen = start + count, hlen + count, gen + count
    drafts, found = device_ngram(hist, hlen, K1 - 1)
    room = jnp.minimum(max_tokens - gen - 1, max_model_len - 2 - start)  # as `Speculation._drafts` limits them
    n = jnp.clip(jnp.minimum(jnp.where(found, K1 - 1, 0), jnp.minimum(room, pages * ps - start - 1)), 0, K1 - 1)
    n = jnp.where(alive, n, 0)
    last = jnp.take_along_axis(hist, jnp.clip(hlen - 1, 0, H - 1)[:, None], 1)
    inputs = jnp.concatenate([last, jnp.where(j[:, 1:] <= n[:, None], drafts, 0)], axis=1)
    pos = start[:, None] + j
    slots = jnp.take_along_axis(table, jnp.clip(pos // ps, 0, m - 1), 1) * ps + pos % ps
    writes = alive[:, None] & (j <= n[:, None]) & (pos < (pages * ps)[:, None])  # never past its pages
    batch = PrefillBatch(jnp.where(alive[:, None], inputs, 0), jnp.where(alive[:, None], pos, 0),
                         jnp.where(writes, slots, -1), table, jnp.where(alive, start + n + 1, 0),
                         jnp.where(alive, n + 1, 0), tags, pages)
    temperature, top_k, top_p, seed, step = columns
    packed = jnp.concatenate([tokens, jax.lax.bitcast_convert_type(logprobs, jnp.int32), count[:, None],
                              ok.astype(jnp.int32)[:, None], ndrafts[:, None]], axis=1)
    return (batch, jnp.where(j[:, 1:] <= n[:, None], drafts, -1), (temperature, top_k, top_p, seed, step + count),
            jnp.stack([start, hlen, gen, max_tokens], axis=1), hist, n, packed)


def unpack_results(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`chain_inputs`' packed results [B, 2(K + 1) + 3] int32 -> (tokens [B, K + 1] int32, logprobs [B, K + 1] f32,
    count [B], ok [B] bool, ndrafts [B])."""
    k1 = (packed.shape[1] - 3) // 2
    return (packed[:, :k1], packed[:, k1:2 * k1].view(np.float32), packed[:, 2 * k1], packed[:, 2 * k1 + 1] > 0,
            packed[:, 2 * k1 + 2])


def chain_host(rows: list[tuple[int, int, np.ndarray, np.ndarray]], b: int, m: int) -> np.ndarray:
    """The host part of a chained verify: its rows (batch row, num_pages, block table [>= m] int32, tags [>= m]
    uint32) -> [b, 2 + 2m] int32 (`chain_inputs`' host); other rows are padding (not alive, null pages, tags 0)."""
    out = np.zeros((b, 2 + 2 * m), np.int32)
    for i, pages, table, tags in rows:
        out[i, 0], out[i, 1], out[i, 2:2 + m], out[i, 2 + m:] = 1, pages, table[:m], tags[:m].view(np.int32)
    return out


def chain_start(tokens: list[list[int]], place: list[int], lengths: list[int], gens: list[int],
                max_tokens: list[int], b: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """The device state of a verify that starts a chain (host-built): each row's tokens so far (prompt + output),
    decode length, tokens generated and max_tokens at batch rows `place` -> (state [b, STATE], hist [b, h]) int32."""
    state, hist = np.zeros((b, STATE), np.int32), np.zeros((b, h), np.int32)
    for i, toks, length, gen, mt in zip(place, tokens, lengths, gens, max_tokens):
        hist[i, :len(toks)] = toks
        state[i] = (length, len(toks), gen, mt)
    return state, hist


def warm_chain(b: int, k: int, m: int, where: jax.sharding.Sharding, page_size: int, max_model_len: int) -> None:
    """Run `chain_inputs` once at a verify shape (b rows, k drafts, m pages) as a chain's first link calls it (its
    state, history and draft counts uploaded from the host, `Speculation._start`) and once as a later link does
    (from the first's outputs): both compile ahead of traffic. Padding rows only: nothing is written anywhere."""
    k1 = k + 1
    verified = jax.device_put((np.zeros((b, k1), np.int32), np.zeros(b, np.int32), np.zeros((b, k1), np.float32),
                               np.zeros(b, bool)), where)
    state, hist = chain_start([], [], [], [], [], b, max_model_len + k1)
    state, hist, nd = jax.device_put((state, hist, np.zeros(b, np.int32)))
    columns = jax.device_put(sampling_columns([None] * b), where)
    for _ in range(2):
        host = jax.device_put(chain_host([], b, m))
        _, _, columns, state, hist, nd, packed = chain_inputs(*verified, nd, state, hist, columns, host,
                                                              page_size=page_size, max_model_len=max_model_len)
    packed.block_until_ready()
