"""The TPU page import kernel (`copy_pages_tpu`: a chunk's pages DMA'd into a pool at page ids) in TPU interpret
mode and legacy `interpret=True` vs `reference_paged.copy_pages_reference`: MLA latent / GQA k / f32 scale shapes,
8-, 16- and 32-bit pools, padding (negative) and out-of-range ids skipped, more pages than the DMAs in flight."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.page_copy_tpu import IN_FLIGHT, copy_pages_tpu
from pallas_kernels.reference_paged import copy_pages_reference

POOL_PAGES = 40
# (trailing dims of one page, dtype): an FP8 MLA latent page, a BF16 GQA page (ps, kv heads, head dim), f32 scales
PAGES = [((16, 576), np.uint8), ((8, 2, 128), np.uint16), ((16, 128), np.float32)]


def _ids(n: int, rng: np.random.Generator) -> np.ndarray:
    """n distinct live ids in [0, POOL_PAGES), then padding (-1), the first page past the pool and a far one."""
    ids = rng.permutation(POOL_PAGES)[:n].astype(np.int32)
    ids[[1, 3, n - 1]] = [-1, POOL_PAGES, 1000]
    return ids


@pytest.mark.parametrize("interpret", [pltpu.InterpretParams(), True], ids=["tpu_interpret", "legacy"])
@pytest.mark.parametrize("page,dtype", PAGES)
def test_copy_pages_matches_reference(page, dtype, interpret):
    rng = np.random.default_rng(len(page))
    n = IN_FLIGHT + 5  # the loop retires DMAs while starting new ones
    draw = lambda *s: rng.integers(0, 1 << 8 * np.dtype(dtype).itemsize - 1, s).astype(dtype)  # noqa: E731
    pool, chunk, ids = draw(2, POOL_PAGES, *page), draw(2, n, *page), _ids(n, rng)
    out = jax.jit(lambda p, c, i: copy_pages_tpu(p, c, i, interpret=interpret))(pool, chunk, ids)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(copy_pages_reference(pool, chunk, ids)))
    assert not np.array_equal(np.asarray(out), pool)  # pages were written


def test_copy_pages_rejects_a_chunk_of_another_page_shape():
    with pytest.raises(ValueError, match="does not fit"):
        copy_pages_tpu(np.zeros((2, 4, 8, 128), np.uint8), np.zeros((2, 1, 8, 256), np.uint8), np.zeros(1, np.int32))
