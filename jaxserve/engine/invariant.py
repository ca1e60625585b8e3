"""Batch-invariant prefill and decode programs (`EngineConfig.deterministic`): the rows of any bucket are computed
in fixed-shape tiles, so a row's arithmetic never depends on how many rows or tokens share its step.

XLA:CPU picks its kernels and their reduction orders by shape (measured, bench/results/batch_invariance.txt): a
matmul row of M = 1 vs M >= 2, of M = 16 vs 32 (f32 768 -> 256); a mean over the last axis of 8 vs 16 rows; the
MoE's algorithm by token count; the paged attention's key block by block-table width. Pinning every bucket to its
largest shape fixed all of them at the price of the largest program every step. Here every program keeps its
normal buckets and loops over tiles of one shape instead:
  * decode: rows in tiles of `decode_tile(cfg)` rows (the last padded with empty rows), one `decode_step` per
    tile, trips = the tiles that hold a live row (a traced count: no empty tile runs, and XLA cannot unroll a
    one-trip loop into a differently fused body);
  * prefill: each row's chunk in tiles of 1 row x `prefill_tile(cfg)` tokens, one `prefill_step` per tile in
    order (a later tile of a row reads its earlier tiles' KV from the pool, as chunked prefill does), empty tiles
    skipped; a row's first token and logprob come from the tile holding its last chunk token.
A tile's padded keys and padded rows contribute exact zeros (the attention's online softmax leaves its running
max and sums unchanged over a block no query sees), so the extra trips a longer neighbour causes change nothing.
The key block of decode attention follows the table width below 128 tokens: `EngineConfig` raises the smallest
page bucket to a whole block in this mode.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.cache import KVPages
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.sampling import Sampled, SamplingArrays
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.paged import DecodeBatch, PrefillBatch

DECODE_TILE_ROWS = 16  # decode rows per tile: c = 16 runs one tile, as the default program's 16-row bucket does
PREFILL_TILE_TOKENS = 64  # prompt tokens per prefill tile (one row): short prompts waste little padding


def decode_tile(cfg: EngineConfig) -> int:
    return min(DECODE_TILE_ROWS, cfg.max_batch)


def prefill_tile(cfg: EngineConfig) -> int:
    return min(PREFILL_TILE_TOKENS, cfg.prefill_chunk)


def decode_program(cfg: EngineConfig, step):  # noqa: ANN001, ANN201
    """programs.decode_step as `cfg` runs it: over row tiles under `cfg.invariant_tiles`, else `step` itself."""
    return functools.partial(tiled_decode_step, step, tile=decode_tile(cfg)) if cfg.invariant_tiles else step


def prefill_program(cfg: EngineConfig, step):  # noqa: ANN001, ANN201
    """programs.prefill_step as `cfg` runs it: over 1-row token tiles under `cfg.invariant_tiles`, else `step`."""
    return functools.partial(tiled_prefill_step, step, tile=prefill_tile(cfg)) if cfg.invariant_tiles else step


def _pad_rows(x: jax.Array, rows: int, fill: int | float) -> jax.Array:
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)


def _rows(tree, start: jax.Array, n: int):  # noqa: ANN001, ANN202
    """Rows [start, start + n) of every array leaf of `tree` (leading axis: rows)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, n, axis=0), tree)


def _put_rows(out, part, start: jax.Array):  # noqa: ANN001, ANN202
    return jax.tree.map(lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p.astype(o.dtype), start, axis=0),
                        out, part)


def tiled_decode_step(step, graphdef: nnx.GraphDef, state: nnx.State, pages: KVPages,  # noqa: ANN001
                      batch: DecodeBatch, samp: SamplingArrays, *, tile: int, integrity: bool,
                      attention: AttentionBackend) -> tuple[Sampled, jax.Array, KVPages]:
    """`step` (programs.decode_step) over tiles of `tile` rows. Shapes as decode_step's: B rows in, B rows out."""
    B = batch.tokens.shape[0]
    R = max(2, -(-B // tile)) * tile  # >= 2 tiles: a slice of the whole batch would be elided and its users hoisted
    fills = DecodeBatch(tokens=0, positions=0, slots=-1, block_tables=0, lengths=0, expected_tags=0, num_pages=0)
    padded = jax.tree.map(lambda x, f: _pad_rows(x, R, f), batch, fills)
    psamp = jax.tree.map(lambda x: jnp.pad(x, ((0, R - B),) + ((0, 0),) * (x.ndim - 1), mode="edge"), samp)
    live = jnp.max(jnp.where(padded.lengths > 0, jnp.arange(R), -1))  # the last live row (padding: length 0)
    # behind a barrier: a trip count XLA can bound to 1 turns the loop into straight-line code, fused otherwise
    trips = (jax.lax.optimization_barrier(live) + tile) // tile
    shapes = jax.eval_shape(lambda b, s: step(graphdef, state, pages, b, s, integrity=integrity,
                                              attention=attention)[:2], _rows(padded, 0, tile), _rows(psamp, 0, tile))
    init = jax.tree.map(lambda s: jnp.zeros((R,) + s.shape[1:], s.dtype), shapes)
    init = (init[0], jnp.ones((R,), jnp.bool_))  # a row no tile ran is padding: not a failed tag check

    def body(t: jax.Array, carry: tuple) -> tuple:
        out, pages = carry
        lo = t * tile
        # the barrier keeps the tile's slice out of the body's fusions: a whole-batch slice (B <= tile) is elided
        rows, s = jax.lax.optimization_barrier((_rows(padded, lo, tile), _rows(psamp, lo, tile)))
        sampled, ok, pages = step(graphdef, state, pages, rows, s, integrity=integrity, attention=attention)
        return _put_rows(out, (sampled, ok), lo), pages

    (sampled, ok), pages = jax.lax.fori_loop(0, trips, body, (init, pages))
    return jax.tree.map(lambda x: x[:B], sampled), ok[:B], pages


def _prefill_tile_batch(batch: PrefillBatch, r: jax.Array, j: jax.Array, tc: int) -> PrefillBatch:
    """Row r's chunk tokens [j * tc, (j + 1) * tc) as a 1-row prefill batch (batch's token axis padded to whole
    tiles); ctx_lens: the context through this tile's last token."""
    def cols(x: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice(x, (r, j * tc), (1, tc))

    cl, ctx = batch.chunk_lens[r], batch.ctx_lens[r]
    n = jnp.clip(cl - j * tc, 0, tc)
    row = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, r, 1, axis=0)  # noqa: E731
    return PrefillBatch(tokens=cols(batch.tokens), positions=cols(batch.positions), slots=cols(batch.slots),
                        block_tables=row(batch.block_tables), ctx_lens=(ctx - cl + j * tc + n)[None],
                        chunk_lens=n[None], expected_tags=row(batch.expected_tags), num_pages=row(batch.num_pages))


def tiled_prefill_step(step, graphdef: nnx.GraphDef, state: nnx.State, pages: KVPages,  # noqa: ANN001
                       batch: PrefillBatch, samp: SamplingArrays, *, tile: int, attention: AttentionBackend,
                       integrity: bool) -> tuple[Sampled, jax.Array, KVPages]:
    """`step` (programs.prefill_step) over 1-row tiles of `tile` chunk tokens, row by row, each row's tiles in
    order. Shapes as prefill_step's: B rows in, B rows out."""
    B, T = batch.tokens.shape
    # >= 2 rows and 2 tiles a row (padding, skipped): a whole-axis slice would be elided and its users hoisted out
    # of the loop, fused otherwise than in a bigger bucket's program
    nj, R = max(2, -(-T // tile)), max(2, B)
    pad = ((0, R - B), (0, nj * tile - T))
    padded = PrefillBatch(
        tokens=jnp.pad(batch.tokens, pad), slots=jnp.pad(batch.slots, pad, constant_values=-1),
        positions=jnp.pad(batch.positions, pad, mode="edge"), block_tables=_pad_rows(batch.block_tables, R, 0),
        ctx_lens=_pad_rows(batch.ctx_lens, R, 0), chunk_lens=_pad_rows(batch.chunk_lens, R, 0),
        expected_tags=None if batch.expected_tags is None else _pad_rows(batch.expected_tags, R, 0),
        num_pages=None if batch.num_pages is None else _pad_rows(batch.num_pages, R, 0))
    samp = jax.tree.map(lambda x: jnp.pad(x, ((0, R - B),) + ((0, 0),) * (x.ndim - 1), mode="edge"), samp)
    last = jnp.maximum(padded.chunk_lens - 1, 0) // tile  # the tile holding each row's last chunk token
    shapes = jax.eval_shape(lambda b, s: step(graphdef, state, pages, b, s, attention=attention,
                                              integrity=integrity)[:2],
                            _prefill_tile_batch(padded, 0, 0, tile), _rows(samp, 0, 1))
    init = (jax.tree.map(lambda s: jnp.zeros((R,) + s.shape[1:], s.dtype), shapes[0]), jnp.ones((R,), jnp.bool_))

    def run(r: jax.Array, j: jax.Array, out: tuple, pages: KVPages) -> tuple:
        sampled, ok, pages = step(graphdef, state, pages, _prefill_tile_batch(padded, r, j, tile), _rows(samp, r, 1),
                                  attention=attention, integrity=integrity)
        got = _put_rows(out, (sampled, ok), r)
        return jax.tree.map(lambda g, o: jnp.where(j == last[r], g, o), got, out), pages

    def body(i: jax.Array, carry: tuple) -> tuple:
        r, j = i // nj, i % nj
        return jax.lax.cond(j * tile < padded.chunk_lens[r], run, lambda r, j, o, p: (o, p), r, j, *carry)

    (sampled, ok), pages = jax.lax.fori_loop(0, R * nj, body, (init, pages))
    return jax.tree.map(lambda x: x[:B], sampled), ok[:B], pages
