"""Per-page checksums (`cache.checksum`): any one changed byte of a page, in any field, changes that page's sum and
no other page's; a copy of a page (elsewhere in a pool, or in a compact chunk) has the same sums."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache import KVLayout, KVPages, init_pages, pages_to_fp8
from jaxserve.cache.checksum import page_checksums, present_fields


def filled(layout: KVLayout, num_pages: int, seed: int = 0) -> KVPages:
    """A pool of `layout` with random bits in every field (tags 0)."""
    pool = init_pages(layout, num_pages)
    rng = np.random.default_rng(seed)
    fields = {}
    for f in present_fields(pool):
        x = getattr(pool, f)
        if x.dtype == jnp.float32:
            fields[f] = jnp.asarray(rng.uniform(0.5, 2.0, x.shape), jnp.float32)
        else:
            fields[f] = jnp.asarray(rng.integers(0, np.iinfo(x.dtype).max, x.shape, dtype=np.int64), x.dtype)
    return KVPages(layout, tags=pool.tags, **fields)


LAYOUTS = {"mla fp8": KVLayout.mla(2, 16, 8, page_size=4, dtype="fp8"),
           "mla bf16 + fp8 index keys": KVLayout.mla(2, 16, 8, page_size=4, dtype="bf16", index_layers=1,
                                                     index_head_dim=8, index_dtype="fp8"),
           "gqa fp8": KVLayout.gqa(2, 2, 8, page_size=4, dtype="fp8")}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_changed_byte_changes_only_its_page(name):
    pool = filled(LAYOUTS[name], 6)
    ids = jnp.arange(6, dtype=jnp.int32)
    base = np.asarray(page_checksums(pool, ids))
    assert base.shape == (6, len(present_fields(pool))) and base.dtype == np.uint32
    rng = np.random.default_rng(1)
    for col, f in enumerate(present_fields(pool)):
        x = np.array(getattr(pool, f))
        raw = x.view(np.uint8).reshape(x.shape[:2] + (-1,))  # [layers, pages, bytes of a page's row]
        layer, page, at = rng.integers(raw.shape[0]), rng.integers(raw.shape[1]), rng.integers(raw.shape[2])
        raw[layer, page, at] ^= 1 << int(rng.integers(8))
        got = np.asarray(page_checksums(KVPages(pool.layout, **{**_fields(pool), f: jnp.asarray(x)}), ids))
        changed = np.argwhere(got != base)
        assert changed.tolist() == [[page, col]], (f, changed)


def test_an_exported_copy_has_the_pools_sums():
    bf16 = filled(KVLayout.mla(2, 16, 8, page_size=4, dtype="bf16"), 8)
    chunk = pages_to_fp8(bf16, jnp.asarray([5, 2, 7], jnp.int32))
    sums = np.asarray(page_checksums(chunk, jnp.arange(3, dtype=jnp.int32)))
    pool = init_pages(chunk.layout, 10)
    put = {f: getattr(pool, f).at[:, jnp.asarray([9, 1, 4])].set(getattr(chunk, f)) for f in present_fields(chunk)}
    moved = KVPages(chunk.layout, tags=pool.tags, **put)
    assert np.array_equal(np.asarray(page_checksums(moved, jnp.asarray([9, 1, 4], jnp.int32))), sums)
    assert not np.array_equal(sums[0], sums[1])


def _fields(pool: KVPages) -> dict[str, jax.Array]:
    return {f: getattr(pool, f) for f in (*present_fields(pool), "tags")}
