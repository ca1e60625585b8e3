"""The speculative verify program's body and its batch: the decode phase's model over k + 1 positions per row (the
last token, then up to k drafts), written into the decode pool and attended like a prefill chunk with logits at
every position (`models.paged.prefill(all_logits=True)`: the tag check first, any pool dtype), then the drafts
accepted or rejected on the device (`acceptance.verify_tokens`).

A row with k_b < k drafts writes only its first k_b + 1 positions (the others' slots are -1; their input token is
0) and its missing drafts are -1, which `verify_tokens` never accepts, so it emits at most k_b + 1 tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.cache import KVPages
from jaxserve.engine.acceptance import Verified, verify_tokens
from jaxserve.engine.batch import DecodeRows, dummy_prefill, padding_prefill
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
