"""KV pages: layout sizes, FP8 quantization bounds and saturation, scatter/gather, hand-off, allocator properties."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.cache import (
    FP8_MAX,
    KVLayout,
    KVPages,
    PageAllocator,
    convert_pages_to_fp8,
    dequantize_fp8,
    gather_tokens,
    init_pages,
    insert_pages,
    quantize_fp8,
    write_tokens,
)
from jaxserve.errors import ConfigError, OutOfPagesError, PageAllocatorError


def fp8_bound(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per-element e4m3 round-to-nearest error: half an ulp, |x|*2^-4 for normals, scale*2^-10 for subnormals."""
    return np.maximum(np.abs(x) * 2.0**-4, scale[..., None] * 2.0**-10) * (1 + 1e-6)


# --- layout sizes -----------------------------------------------------------------------------------------------

def test_bytes_per_token_kimi_and_glm():
    kimi = KVLayout.mla(61, 512, 64)
    assert kimi.bytes_per_token() == 61 * 576 * 2
    assert kimi.with_dtype("fp8").bytes_per_token() == 61 * (576 + 4)
    assert kimi.tokens_per_gib() / kimi.with_dtype("fp8").tokens_per_gib() == pytest.approx(580 / 1152)
    glm = KVLayout.gqa(92, 8, 128, dtype="fp8")
    assert glm.bytes_per_token() == 92 * 2 * 8 * (128 + 4)


def test_pool_nbytes_match_layout():
    for lay in (KVLayout.mla(3, 16, 8, page_size=4, dtype="fp8"), KVLayout.gqa(2, 2, 8, page_size=8)):
        pages = init_pages(lay, 5)
        assert pages.nbytes() == lay.bytes_per_token() * 5 * lay.page_size + 5 * 4  # + one uint32 tag per page


def test_bad_layout_raises_typed_error():
    with pytest.raises(ConfigError) as e:
        KVLayout("mha", 2)
    assert e.value.value == "mha"
    with pytest.raises(ConfigError):
        KVLayout.gqa(2, 0, 128)


# --- FP8 quantization --------------------------------------------------------------------------------------------

def test_quantize_fp8_error_bound():
    x = np.asarray(jax.random.normal(jax.random.key(0), (64, 96))) * np.logspace(-3, 3, 64)[:, None]
    q, s = quantize_fp8(jnp.asarray(x, jnp.float32))
    err = np.abs(np.asarray(dequantize_fp8(q, s)) - x)
    assert np.all(err <= fp8_bound(x, np.asarray(s)))
    assert err.max() > 0  # really quantized


def test_quantize_fp8_saturates_without_nan():
    x = jnp.array([[1e30, -1e30, 1.0, 0.0], [np.inf, -np.inf, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
    q, s = quantize_fp8(x)
    dq = np.asarray(dequantize_fp8(q, s))
    s = np.asarray(s)
    assert not np.isnan(np.asarray(q.astype(jnp.float32))).any() and not np.isnan(dq).any()
    assert np.all(s > 0) and np.all(np.isfinite(s))
    np.testing.assert_array_equal(np.abs(np.asarray(q.astype(jnp.float32))[:2, :2]), FP8_MAX)
    np.testing.assert_allclose(dq[:2, :2], np.array([[1, -1], [1, -1]]) * FP8_MAX * s[:2, None], rtol=1e-6)
    np.testing.assert_allclose(dq[0, 0], 1e30, rtol=1e-6)
    np.testing.assert_array_equal(dq[2], 0.0)


# --- write / gather ----------------------------------------------------------------------------------------------

def _random_rows(key, lay: KVLayout, n: int):
    if lay.kind == "mla":
        return jax.random.normal(key, (n, lay.latent_dim)) * 3.0
    k1, k2 = jax.random.split(key)
    shape = (n, lay.kv_heads, lay.head_dim)
    return jax.random.normal(k1, shape) * 3.0, jax.random.normal(k2, shape)


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_write_gather_round_trip(kind, dtype):
    ps, num_pages = 4, 9
    lay = (KVLayout.mla(2, 16, 8, page_size=ps, dtype=dtype) if kind == "mla"
           else KVLayout.gqa(2, 2, 8, page_size=ps, dtype=dtype))
    pages = init_pages(lay, num_pages)
    block_table = np.array([[5, 2, 7], [3, 8, 1]], np.int32)  # non-contiguous
    n_tok = 10  # per sequence: 2.5 pages
    pos = np.arange(n_tok)
    slots = np.concatenate([block_table[b][pos // ps] * ps + pos % ps for b in range(2)])
    slots = np.concatenate([slots, [-1, -1]]).astype(np.int32)  # padding rows write nothing
    rows = _random_rows(jax.random.key(1), lay, slots.size)
    pages = write_tokens(pages, 1, rows, jnp.asarray(slots))
    got = gather_tokens(pages, 1, jnp.asarray(block_table), max_len=n_tok)
    want = [np.asarray(r)[:-2].reshape(2, n_tok, *np.shape(r)[1:]) for r in (rows if kind == "gqa" else (rows,))]
    got = got if kind == "gqa" else (got,)
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.shape == w.shape
        if dtype == "bf16":
            np.testing.assert_array_equal(g, np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32)))
        else:
            scale = np.abs(w).max(-1) / FP8_MAX
            assert np.all(np.abs(g - w) <= fp8_bound(w, scale) + 1e-7)
    # layer 0 and every slot not written stayed zero (all-zero bits: +0.0)
    for leaf in (pages.latent, pages.k, pages.v):
        if leaf is not None:
            assert not np.asarray(leaf[0].astype(jnp.float32)).any()
            untouched = np.ones((num_pages, ps), bool)
            real = slots[slots >= 0]
            untouched[real // ps, real % ps] = False
            assert not np.asarray(leaf[1].astype(jnp.float32))[untouched].any()


@pytest.mark.parametrize("dtype,bits,values", [("fp8", jnp.uint8, jnp.float8_e4m3fn), ("bf16", jnp.uint16, jnp.bfloat16)])
def test_pools_store_bits_and_layer_views_values(dtype, bits, values):
    mla = KVLayout.mla(2, 16, 8, page_size=4, dtype=dtype)
    gqa = KVLayout.gqa(2, 2, 8, page_size=4, dtype=dtype)
    for lay in (mla, gqa):
        pages = init_pages(lay, 5)
        stored = [x for x in (pages.latent, pages.k, pages.v) if x is not None]
        assert stored and all(x.dtype == bits for x in stored)
        views = [x for x in pages.layer(1) if x is not None and x.ndim == (3 if lay.kind == "mla" else 4)]
        assert views and all(x.dtype == values for x in views)
    # the view is the stored bit pattern, not a rounded value
    rows = jax.random.normal(jax.random.key(3), (8, 24)) * 5.0
    pages = write_tokens(init_pages(mla, 5), 1, rows, jnp.arange(8, dtype=jnp.int32) + 4)
    lat, _ = pages.layer(1)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(lat, bits)), np.asarray(pages.latent[1]))


@pytest.mark.parametrize("kind", ["mla", "gqa"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gather_layer_equals_layer_through_the_block_table(kind, dtype):
    lay = (KVLayout.mla(2, 16, 8, page_size=4, dtype=dtype) if kind == "mla"
           else KVLayout.gqa(2, 2, 8, page_size=4, dtype=dtype))
    pages = init_pages(lay, 9)
    slots = jnp.arange(4, 36, dtype=jnp.int32)
    pages = write_tokens(pages, 1, _random_rows(jax.random.key(4), lay, 32), slots)
    bt = jnp.asarray([[5, 2, 0], [3, 8, 1]], jnp.int32)
    compact, local = pages.gather_layer(1, bt)
    assert local.shape == bt.shape
    for c, full in zip(compact, pages.layer(1)):
        if full is None:
            assert c is None
            continue
        assert c.dtype == full.dtype and c.shape[0] == bt.size
        np.testing.assert_array_equal(np.asarray(c[local].astype(jnp.float32)), np.asarray(full[bt].astype(jnp.float32)))


def test_from_values_stores_bits():
    lay = KVLayout.mla(1, 8, 8, page_size=4, dtype="bf16")
    x = jax.random.normal(jax.random.key(5), (1, 3, 4, 16)).astype(jnp.bfloat16)
    pages = KVPages.from_values(lay, latent=x)
    assert pages.latent.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(pages.layer(0)[0]), np.asarray(x[0]))
    assert KVPages.from_values(lay, latent=pages.latent).latent is pages.latent  # bits pass through


def test_slot_minus_one_writes_nothing():
    lay = KVLayout.mla(1, 8, 8, page_size=4, dtype="fp8")
    pages = init_pages(lay, 3)
    rows = jnp.full((4, 16), 7.0)
    out = write_tokens(pages, 0, rows, jnp.full((4,), -1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(out.latent.astype(jnp.float32)), 0)
    np.testing.assert_array_equal(np.asarray(out.latent_scale), np.asarray(pages.latent_scale))


@pytest.mark.parametrize("kind,dtype", [("mla", "fp8"), ("mla", "bf16"), ("gqa", "fp8")])
def test_rowwise_write_equals_the_scatter(kind, dtype):
    """The TPU programs' writes (`rowwise=True`: MLA rows one by one, GQA's FP8 scales as whole page rows) leave the
    same pool as the scatter: padding (-1) and slots past the pool write nothing, every other row lands at its
    (layer, page, offset), several new tokens of one page (0 and 3, 17 and 19) all kept."""
    if kind == "mla":
        lay = KVLayout.mla(3, 8, 8, page_size=4, dtype=dtype)
        old, rows = jnp.ones((20, 16)), jax.random.normal(jax.random.key(9), (6, 16)) * 5
    else:
        lay = KVLayout.gqa(3, 2, 8, page_size=4, dtype=dtype)
        old = (jnp.ones((20, 2, 8)), jnp.full((20, 2, 8), 2.0))
        rows = tuple(jax.random.normal(k, (6, 2, 8)) * 5 for k in jax.random.split(jax.random.key(9)))
    pages = write_tokens(init_pages(lay, 5), 1, old, jnp.arange(20, dtype=jnp.int32))
    slots = jnp.asarray([3, -1, 17, 19, 20, 0], jnp.int32)  # 20: page 5, past the pool
    tags = jnp.arange(1, 7, dtype=jnp.uint32)
    for layer in (0, 1):
        want = write_tokens(pages, layer, rows, slots, tags)
        got = write_tokens(pages, layer, rows, slots, tags, rowwise=True)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gqa_dma_import_equals_the_scatter():
    """The TPU hand-off import of GQA pages (`insert_pages(dma=...)`: K / V DMA'd through their head-major rows,
    the FP8 scales through their [L * Hkv, P, ps] rows; TPU interpret mode here) writes what the scatter does:
    each chunk page at its id, a padding id (-1) and an id past the pool nothing."""
    lay = KVLayout.gqa(2, 2, 8, page_size=4, dtype="fp8")
    rng = np.random.default_rng(3)
    pool = jax.tree.map(lambda x: jnp.asarray(rng.integers(1, 255, x.shape), x.dtype) if x.dtype == jnp.uint8
                        else x, init_pages(lay, 7))
    chunk = init_pages(lay, 4)
    chunk = KVPages(lay, k=jnp.asarray(rng.integers(1, 255, chunk.k.shape), jnp.uint8),
                    v=jnp.asarray(rng.integers(1, 255, chunk.v.shape), jnp.uint8),
                    k_scale=jnp.asarray(rng.uniform(1, 2, chunk.k_scale.shape), jnp.float32),
                    v_scale=jnp.asarray(rng.uniform(1, 2, chunk.v_scale.shape), jnp.float32), tags=chunk.tags)
    ids = jnp.asarray([5, -1, 2, 7], jnp.int32)  # 7: past the pool
    want = insert_pages(pool, chunk, ids)
    got = insert_pages(pool, chunk, ids, dma="interpret")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (np.asarray(got.k_scale)[:, [5, 2]] == np.asarray(chunk.k_scale)[:, [0, 2]]).all()


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_bf16_to_fp8_handoff(kind):
    ps = 4
    lay = KVLayout.mla(2, 16, 8, page_size=ps) if kind == "mla" else KVLayout.gqa(2, 2, 8, page_size=ps)
    src = init_pages(lay, 6)
    src_pages = np.array([4, 1, 3], np.int32)
    slots = (src_pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int32)
    rows = _random_rows(jax.random.key(2), lay, slots.size)
    for layer in range(2):
        src = write_tokens(src, layer, rows, jnp.asarray(slots))
    dst_pages = np.array([7, 2, 5], np.int32)  # the decode pool numbers pages its own way
    dst = convert_pages_to_fp8(src, init_pages(lay.with_dtype("fp8"), 9), jnp.asarray(src_pages),
                               jnp.asarray(dst_pages))
    # identical to quantizing the same bf16 rows straight into the fp8 pool
    direct = init_pages(lay.with_dtype("fp8"), 9)
    bf16_rows = jax.tree.map(lambda r: r.astype(jnp.bfloat16), rows)
    dslots = (dst_pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int32)
    for layer in range(2):
        direct = write_tokens(direct, layer, bf16_rows, jnp.asarray(dslots))
    for a, b in zip(jax.tree_util.tree_leaves(dst), jax.tree_util.tree_leaves(direct)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    g_src = gather_tokens(src, 1, jnp.asarray(src_pages[None]))
    g_dst = gather_tokens(dst, 1, jnp.asarray(dst_pages[None]))
    for s_, d_ in zip(jax.tree_util.tree_leaves(g_src), jax.tree_util.tree_leaves(g_dst)):
        s_, d_ = np.asarray(s_), np.asarray(d_)
        assert np.all(np.abs(s_ - d_) <= fp8_bound(s_, np.abs(s_).max(-1) / FP8_MAX) + 1e-7)


# --- allocator -----------------------------------------------------------------------------------------------

def test_allocator_errors_carry_values():
    a = PageAllocator(4)  # 3 allocatable, page 0 reserved
    with pytest.raises(OutOfPagesError) as e:
        a.allocate(4)
    assert e.value.value == 4 and a.num_free == 3  # all or nothing
    (p, t), = a.allocate(1)
    assert p != 0
    with pytest.raises(PageAllocatorError) as e:
        a.free(p, t + 1)
    assert e.value.value == t + 1 and e.value.param == "tag"
    a.free(p, t)
    with pytest.raises(PageAllocatorError) as e:
        a.free(p, t)  # double free
    assert e.value.value == p
    for bad in (0, 4, -1):
        with pytest.raises(PageAllocatorError) as e:
            a.free(bad, 1)
        assert e.value.value == bad


def test_allocator_shards_keep_each_rank_in_its_range():
    """DP attention: 3 shards of 4 pages; each shard's first page is its null page, allocations stay in range."""
    a = PageAllocator(12, shards=3)
    assert a.capacity == 9 and [a.num_free_in(s) for s in range(3)] == [3, 3, 3]
    got = {s: [p for p, _ in a.allocate(3, shard=s)] for s in range(3)}
    assert got == {0: [1, 2, 3], 1: [5, 6, 7], 2: [9, 10, 11]}
    with pytest.raises(OutOfPagesError):
        a.allocate(1, shard=1)  # shard 1 is full
    a.free(6, a.tags[6])
    assert a.num_free_in(1) == 1 and a.num_free_in(0) == 0 and a.allocate(1, shard=1)[0][0] == 6
    for null in (0, 4, 8):
        with pytest.raises(PageAllocatorError, match="reserved null page"):
            a.free(null, 1)
    with pytest.raises(PageAllocatorError) as e:
        a.allocate(1, shard=3)
    assert e.value.value == 3
    with pytest.raises(ConfigError):
        PageAllocator(10, shards=3)


def test_engine_config_splits_rows_and_pools_over_dp_ranks():
    from jaxserve.engine import EngineConfig

    c = EngineConfig(devices=8, sharding="dp_attention", max_batch=32, num_decode_pages=1024, num_prefill_pages=512)
    assert c.dp_ranks == 8 and c.row_buckets == [8, 16, 32]
    assert EngineConfig(devices=8, sharding="dp_attention", disaggregate=True, max_batch=32).dp_ranks == 4
    assert EngineConfig(devices=8).dp_ranks == 1 and EngineConfig(devices=8).row_buckets[0] == 1
    with pytest.raises(ConfigError, match="max_batch must divide"):
        EngineConfig(devices=8, sharding="dp_attention", max_batch=12)


OPS = st.lists(st.tuples(st.sampled_from(["alloc", "free", "share", "stale", "double", "sync"]),
                         st.integers(0, 1000)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(2, 12), ops=OPS)
def test_allocator_invariants(num_pages, ops):
    a = PageAllocator(num_pages)
    device_tags = a.device_tags()
    owners: list[tuple[int, int]] = []  # one entry per reference held
    last_tag = {p: 0 for p in range(num_pages)}
    for op, r in ops:
        if op == "alloc":
            n = r % 4
            if n > a.num_free:
                before = a.tags
                with pytest.raises(OutOfPagesError):
                    a.allocate(n)
                np.testing.assert_array_equal(a.tags, before)
                continue
            for p, t in a.allocate(n):
                assert t != last_tag[p] and t != 0  # tag changes on every (re)allocation
                last_tag[p] = t
                owners.append((p, t))
        elif op == "free" and owners:
            a.free(*owners.pop(r % len(owners)))
        elif op == "share" and owners:
            p, t = owners[r % len(owners)]
            a.share(p, t)
            owners.append((p, t))
        elif op == "stale" and owners:
            p, t = owners[r % len(owners)]
            with pytest.raises(PageAllocatorError):
                a.free(p, (t + 1) & 0xFFFFFFFF)
        elif op == "double":
            free_pages = [p for p in range(1, num_pages) if p not in {q for q, _ in owners}]
            if free_pages:
                p = free_pages[r % len(free_pages)]
                with pytest.raises(PageAllocatorError):
                    a.free(p, int(a.tags[p]))
        elif op == "sync":
            device_tags = a.sync_device_tags(device_tags)
            np.testing.assert_array_equal(np.asarray(device_tags), a.live_tags)
        held = {p for p, _ in owners}
        assert a.num_free + a.num_used == a.capacity
        assert a.num_used == len(held)
        for p in range(1, num_pages):
            assert a.refcount(p) == sum(q == p for q, _ in owners) >= 0
    for p, t in owners:
        a.free(p, t)
    assert a.num_free == a.capacity and a.num_used == 0
    np.testing.assert_array_equal(np.asarray(a.sync_device_tags(device_tags)), a.live_tags)


def test_tag_wrap_skips_zero_and_previous():
    a = PageAllocator(2)
    a._tags[1] = 0xFFFFFFFF  # white-box: jump to the wrap point
    (p, t), = a.allocate(1)
    assert p == 1 and t == 1
