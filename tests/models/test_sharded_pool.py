"""DP attention's tag check and KV row writes per page shard (`sharded.check_tags_per_shard`, `write_per_shard`) on a
4-device CPU mesh: the same pool and the same ok flags as the global `check_tags` / `write_tokens`, a page of
another rank failing its row, and no collective in the compiled program (the partitioner's version gathered the
tags and every row)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache import KVLayout, KVPages, check_tags, init_pages, insert_pages, write_tokens
from jaxserve.hlo import collectives
from jaxserve.models import sharded
from jaxserve.sharding import Parallel, ShardingRules, make_mesh, pool_sharding

RANKS, LOCAL, PS, ROWS, M = 4, 4, 4, 8, 3  # 4 ranks x 4 pages of 4 slots; 2 rows a rank, 3 pages a row


@pytest.fixture(scope="module")
def setup():
    par = Parallel(make_mesh(jax.devices()[:RANKS], dp=RANKS), ShardingRules.preset("dp_attention"))
    lay = KVLayout.mla(2, 8, 4, page_size=PS, dtype="fp8")
    rng = np.random.default_rng(0)
    tags = jnp.asarray(rng.integers(1, 1 << 30, RANKS * LOCAL), jnp.uint32)
    pages = dataclasses.replace(init_pages(lay, RANKS * LOCAL), tags=tags)
    fields = ("latent", "latent_scale", "tags")
    pages = jax.device_put(pages, KVPages(lay, **{f: pool_sharding(par, f, getattr(pages, f).shape) for f in fields}))
    # row r lives on rank r // 2: its pages are that rank's pages 1..3 (page 0 of each rank is its null page)
    tables = (np.arange(ROWS) // 2)[:, None] * LOCAL + np.arange(1, M + 1)[None, :]
    return par, pages, jnp.asarray(tables, jnp.int32), rng


def test_check_per_shard_equals_global_and_fails_a_foreign_page(setup):
    par, pages, tables, _ = setup
    expected = pages.tags[tables]
    n = jnp.full((ROWS,), M, jnp.int32)
    bad_tag = expected.at[1, 2].set(7)  # row 1: a stale tag
    foreign = tables.at[4, 0].set(1)  # row 4 (rank 2) names rank 0's page 1 with its true tag
    foreign_tags = pages.tags[foreign]
    for bt, exp in ((tables, expected), (tables, bad_tag), (foreign, foreign_tags)):
        got = np.asarray(sharded.check_tags_per_shard(par, pages.tags, bt, exp, n))
        ref = np.asarray(check_tags(pages.tags, bt, exp, n))
        if bt is foreign:  # the global check passes it; per shard a row reads only its own rank's pages
            assert ref.all() and not got[4] and got[np.arange(ROWS) != 4].all()
        else:
            np.testing.assert_array_equal(got, ref)
    assert not np.asarray(sharded.check_tags_per_shard(par, pages.tags, tables, bad_tag, n))[1]


def test_write_per_shard_equals_global_write(setup):
    par, pages, tables, rng = setup
    rows = jnp.asarray(rng.normal(size=(ROWS, 12)), jnp.float32)
    slots = tables[:, 1] * PS + jnp.arange(ROWS) % PS
    slots = slots.at[3].set(-1)  # padding writes nothing
    slot_tags = jnp.asarray(rng.integers(1, 1 << 30, ROWS), jnp.uint32)
    write = lambda p, r, s, t: write_tokens(p, 1, r, s, t)  # noqa: E731
    got = jax.jit(lambda p, r, s, t: sharded.write_per_shard(par, write, p, r, s, t))
    ref = write(pages, rows, slots, slot_tags)
    out = got(pages, rows, slots, slot_tags)
    for f in ("latent", "latent_scale", "tags"):
        np.testing.assert_array_equal(np.asarray(getattr(out, f)), np.asarray(getattr(ref, f)))
    live = np.asarray(slots)[np.asarray(slots) >= 0]
    assert set(np.flatnonzero(np.asarray(out.tags != pages.tags))) == set(live // PS)  # each rank its own pages
    text = got.lower(pages, rows, slots, slot_tags).compile().as_text()
    assert not collectives(text)


def test_import_per_shard_equals_global_insert(setup):
    """The TPU hand-off import (`insert_per_shard`: the chunk's value pages DMA'd by `copy_pages_tpu`, here in TPU
    interpret mode) writes what the global `insert_pages` does: each rank its own pages, a padding id nothing, and a
    tag mismatch in a request whose pages span two ranks fails that request on both (no page of it, tags 0)."""
    par, pages, _, rng = setup
    n = 6
    chunk = jax.device_put(dataclasses.replace(
        init_pages(pages.layout, n), latent=jnp.asarray(rng.integers(1, 255, (2, n, PS, 12)), jnp.uint8),
        latent_scale=jnp.asarray(rng.uniform(1, 2, (2, n, PS)), jnp.float32),
        tags=jnp.asarray(rng.integers(1, 1 << 30, n), jnp.uint32)))
    ids = jnp.asarray([1, 6, -1, 9, 14, 3], jnp.int32)  # ranks 0, 1, padding, 2, 3, 0
    groups = jnp.asarray([0, 0, 0, 1, 1, 1], jnp.int32)  # request 1 spans ranks 2, 3 and 0
    expected = chunk.tags.at[4].set(7)  # request 1 carries a stale tag
    dst_tags = jnp.asarray(rng.integers(1, 1 << 30, n), jnp.uint32)
    got = jax.jit(lambda p, c, *a: sharded.insert_per_shard(par, p, c, *a, dma="interpret"))(
        pages, chunk, ids, expected, dst_tags, groups)
    ref = insert_pages(pages, chunk, ids, expected, dst_tags, groups)
    for f in ("latent", "latent_scale", "tags"):
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(ref, f)))
    assert (np.asarray(got.latent)[:, [1, 6]] == np.asarray(chunk.latent[:, :2])).all()  # request 0 written
    assert not np.asarray(got.tags)[[9, 14, 3]].any()  # request 1: no page, tags 0 on every rank
