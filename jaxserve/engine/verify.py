"""The speculative verify program's body and its batch: the decode phase's model over k + 1 positions per row (the
last token, then up to k drafts), written into the decode pool and attended like a prefill chunk with logits at
every position (`models.paged.prefill(all_logits=True)`: the tag check first, any pool dtype), then the drafts
accepted or rejected on the device (`acceptance.verify_tokens`). The batch, its drafts and its sampling columns go
to the device as one packed int32 array (`upload_verify`: one transfer, where a pytree of them took 15), split there
by the jitted `unpack_verify`, as the decode batch is (`batch.DecodeRows.upload`).

A row with k_b < k drafts writes only its first k_b + 1 positions (the others' slots are -1; their input token is
0) and its missing drafts are -1, which `verify_tokens` never accepts, so it emits at most k_b + 1 tokens.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.cache import KVPages
from jaxserve.engine.acceptance import Verified, verify_tokens
from jaxserve.engine.batch import DecodeRows, dummy_prefill, padding_prefill, sampling_columns
from jaxserve.engine.sampling import SamplingArrays
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.paged import PrefillBatch, prefill


def verify_step(graphdef: nnx.GraphDef, state: nnx.State, pages: KVPages, batch: PrefillBatch, drafts: jax.Array,
                samp: SamplingArrays, *, attention: AttentionBackend, integrity: bool
                ) -> tuple[Verified, jax.Array, KVPages]:
    """batch: [B, k + 1] positions per row (`verify_batch`); drafts [B, k] int32.
    -> (Verified: tokens [B, k + 1] int32, count [B] int32 in 1..k + 1, logprobs [B, k + 1] f32; ok [B] bool; pages).
    A row that fails the tag check writes nothing (its count is meaningless: the host fails the request)."""
    model = nnx.merge(graphdef, state)
    logits, pages, ok = prefill(model, pages, batch, all_logits=True, attention=attention, integrity=integrity)
    # n-gram drafts are deterministic (q one-hot); key None: `sample`'s own per-row streams (seed, step + j)
    return verify_tokens(logits, drafts, None, samp, None), ok, pages


def verify_batch(rows: DecodeRows, idx: np.ndarray, place: list[int], drafts: list[list[int]], b: int, k: int,
                 m: int) -> tuple[PrefillBatch, np.ndarray]:
    """The verify batch of DecodeRows rows idx [n] at batch rows `place`, each with its drafts (<= k tokens), padded to
    b rows and m pages, on the host: (PrefillBatch of numpy arrays, drafts [b, k] int32, -1 padding). Row i's
    positions are length .. length + k (the last sampled token first); slots past its own drafts are -1."""
    ps, t = rows.page_size, k + 1
    x = padding_prefill(b, t, m)
    draft_arr = np.full((b, k), -1, np.int32)
    for i, slot, d in zip(place, idx.tolist(), drafts):
        n, start = len(d), int(rows.length[slot])
        x.tokens[i, 0] = rows.last[slot]
        x.tokens[i, 1:n + 1] = d
        draft_arr[i, :n] = d
        pos = start + np.arange(t)
        x.positions[i] = pos
        table = rows.tables[slot, :m]
        x.slots[i, :n + 1] = table[pos[:n + 1] // ps] * ps + pos[:n + 1] % ps
        x.block_tables[i] = table
        x.expected_tags[i] = rows.tags[slot, :m]
        x.ctx_lens[i], x.chunk_lens[i], x.num_pages[i] = start + n + 1, n + 1, rows.num_pages[slot]
    return x, draft_arr


def dummy_verify(b: int, k: int, m: int) -> tuple[PrefillBatch, jax.Array, SamplingArrays]:
    """An all-padding verify batch of bucket shape (b rows, k drafts, m pages): for warm-up compiles."""
    batch, samp = dummy_prefill(b, k + 1, m)
    return batch, jnp.full((b, k), -1, jnp.int32), samp


def upload_verify(batch: PrefillBatch, drafts: np.ndarray, columns: tuple[np.ndarray, ...],
                  where: jax.sharding.Sharding) -> tuple[PrefillBatch, jax.Array, tuple[jax.Array, ...]]:
    """A verify batch of host arrays (`verify_batch`), its drafts [B, k] and sampling columns
    (`batch.sampling_columns`) uploaded to `where` as one [B, 3(k + 1) + 2m + 3 + k + 5] int32 array and split on
    the device -> (PrefillBatch, drafts, columns) as device arrays."""
    as_i32 = [x if x.dtype == np.int32 else x.view(np.int32) for x in columns]  # f32 / uint32 bits
    packed = np.concatenate([batch.tokens, batch.positions, batch.slots, batch.block_tables,
                             batch.expected_tags.view(np.int32), batch.ctx_lens[:, None], batch.chunk_lens[:, None],
                             batch.num_pages[:, None], drafts] + [x[:, None] for x in as_i32], axis=1)
    return unpack_verify(jax.device_put(packed, where), batch.tokens.shape[1], batch.block_tables.shape[1])


@functools.partial(jax.jit, static_argnames=("t", "m"))
def unpack_verify(packed: jax.Array, t: int, m: int) -> tuple[PrefillBatch, jax.Array, tuple[jax.Array, ...]]:
    """`upload_verify`'s packed array (t = k + 1 positions, m pages per row) -> (PrefillBatch, drafts, columns)."""
    cut = np.cumsum([t, t, t, m, m, 1, 1, 1, t - 1, 1, 1, 1, 1]).tolist()
    tok, pos, slots, table, tags, ctx, chunk, pages, drafts, temp, top_k, top_p, seed, step = jnp.split(packed, cut, 1)
    bits = jax.lax.bitcast_convert_type
    batch = PrefillBatch(tok, pos, slots, table, ctx[:, 0], chunk[:, 0], bits(tags, jnp.uint32), pages[:, 0])
    return batch, drafts, (bits(temp[:, 0], jnp.float32), top_k[:, 0], bits(top_p[:, 0], jnp.float32),
                           bits(seed[:, 0], jnp.uint32), step[:, 0])


def padding_verify(b: int, k: int, m: int, where: jax.sharding.Sharding
                   ) -> tuple[PrefillBatch, jax.Array, tuple[jax.Array, ...]]:
    """An all-padding verify batch uploaded as the scheduler uploads one (`upload_verify`): for warm-up runs, which
    also compile `unpack_verify` at that shape."""
    return upload_verify(padding_prefill(b, k + 1, m), np.full((b, k), -1, np.int32), sampling_columns([None] * b),
                         where)
