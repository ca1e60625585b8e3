"""KV page integrity: compare each request's expected (page, tag) pairs with the pool's device tags, before any
read of its pages (prefill chunks, decode) and at the prefill -> decode hand-off (`insert_pages`).

The device tags (`KVPages.tags`) are what the device last witnessed: the generation the host announced when it
allocated (or freed: 0) the page, overwritten by every KV write with the writer's tag for that page. So the check
catches a host bookkeeping slip (a page freed or reallocated under a running request) and a device-side write
through a stale slot (it stamps the stale writer's tag). It does not catch a write that bypasses `write_tokens` /
`insert_pages` and leaves the tag alone: a tag is not a checksum of the contents.

Run as a separate batched check ahead of the attention kernel (not inside it: thread groups could race), then
fail closed: `guard_tables` points a failed row's block table at the null page and its writes nowhere before any
gather or kernel sees it, `mask_outputs` zeroes its attention output, and the host aborts exactly those requests
(`integrity_errors`).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache.layout import NULL_PAGE
from jaxserve.errors import KVIntegrityError


@functools.partial(jax.jit, static_argnames=("enabled",))
def check_tags(pool_tags: jax.Array, block_tables: jax.Array, expected_tags: jax.Array, num_pages: jax.Array,
               *, enabled: bool = True) -> jax.Array:
    """Per-row tag check: one gather, one compare, one reduce.

    pool_tags [P] uint32; block_tables [B, M] int32; expected_tags [B, M] uint32; num_pages [B] int32.
    Only the first num_pages[b] entries of row b count. A page id outside [0, P) or num_pages outside [0, M]
    fails the row. Returns ok [B] bool. `enabled=False` (static) returns all True without reading anything.
    """
    b, m = block_tables.shape
    if not enabled:
        return jnp.ones((b,), jnp.bool_)
    p = pool_tags.shape[0]
    bt = block_tables.astype(jnp.int32)
    in_range = (bt >= 0) & (bt < p)
    got = pool_tags[jnp.clip(bt, 0, p - 1)]  # clipped ids are already failed by in_range
    live = jnp.arange(m, dtype=jnp.int32)[None, :] < num_pages[:, None]
    row_ok = jnp.all(~live | ((got == expected_tags.astype(pool_tags.dtype)) & in_range), axis=1)
    return row_ok & (num_pages >= 0) & (num_pages <= m)


def guard_tables(ok: jax.Array, block_tables: jax.Array) -> jax.Array:
    """block_tables [B, M] int32 with every entry of a failed row (ok [B] bool False) set to the null page."""
    return jnp.where(ok[:, None], block_tables, NULL_PAGE)


def page_tags_at(expected_tags: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """The row's expected tag of the page holding each position: expected_tags [B, M] uint32, positions [B, T]
    (or [B]) int32 absolute -> [B, T] (or [B]) uint32 (positions past the table clip to its last entry; their
    slots are padding)."""
    m = expected_tags.shape[1]
    idx = jnp.clip(positions // page_size, 0, m - 1)
    if positions.ndim == 1:
        return jnp.take_along_axis(expected_tags, idx[:, None], axis=1)[:, 0]
    return jnp.take_along_axis(expected_tags, idx, axis=1)


@jax.jit
def mask_outputs(ok: jax.Array, x: jax.Array) -> jax.Array:
    """Zero the rows of x [B, ...] whose ok [B] bool is False; other rows are returned bit-identical."""
    return jnp.where(ok.reshape(ok.shape + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def integrity_errors(ok: np.ndarray | jax.Array, request_ids: Sequence[str]) -> list[KVIntegrityError]:
    """Host side: one KVIntegrityError per failed row (value = request id), for aborting exactly those requests."""
    ok = np.asarray(ok)
    return [KVIntegrityError(f"KV page tags of request {rid!r} no longer match the pool; aborted",
                             value=rid, param="request_id")
            for rid, good in zip(request_ids, ok, strict=True) if not good]
