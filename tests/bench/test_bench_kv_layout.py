"""bench/kv_layout_quality.py: its per-token emulation is exactly what an FP8 page pool stores and gives back, its
FlashMLA emulation keeps the rope part in BF16 and one scale per tile, and the byte counts are the layouts'
(Kimi: 580 B per-token, 656 B FlashMLA, per token and layer)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.cache import KVLayout, gather_tokens, init_pages, write_tokens
from test_bench_smoke import load


def test_emulated_layouts_and_their_bytes() -> None:
    kv = load("kv_layout_quality")
    rank, rope, n = 64, 16, 8
    rng = np.random.default_rng(0)
    latent = jnp.asarray(rng.standard_normal((n, rank + rope)) * np.r_[np.ones(rank), 20 * np.ones(rope)],
                         jnp.float32)  # rope columns larger, as an un-normed rope part is
    pool = init_pages(KVLayout.mla(1, rank, rope, page_size=n, dtype="fp8"), 2)
    pool = write_tokens(pool, 0, latent, jnp.arange(n, dtype=jnp.int32) + n)  # page 1
    stored = gather_tokens(pool, 0, jnp.asarray([[1]], jnp.int32))[0]
    np.testing.assert_array_equal(np.asarray(kv.kv_per_token(latent, rank)), np.asarray(stored))
    tiled = np.asarray(kv.kv_tiled(latent, rank, tile=16))
    np.testing.assert_array_equal(tiled[:, rank:], np.asarray(latent[:, rank:].astype(jnp.bfloat16), np.float32))
    err_tiled = np.abs(tiled[:, :rank] - np.asarray(latent[:, :rank])).max()
    err_token = np.abs(np.asarray(stored)[:, :rank] - np.asarray(latent[:, :rank])).max()
    assert err_tiled < err_token  # c_kv no longer shares the rope part's scale
    assert kv.bytes_per_token("fp8_per_token", 512, 64) == 580
    assert kv.bytes_per_token("flashmla", 512, 64) == 656
    assert kv.bytes_per_token("bf16", 512, 64) == 1152
