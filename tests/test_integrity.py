"""KV page integrity: fault injection (free + reallocate under a running request), masking, the disabled switch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.cache.integrity import check_tags, integrity_errors, mask_outputs
from jaxserve.cache.pages import NULL_PAGE, PageAllocator
from jaxserve.errors import KVIntegrityError

B, M, P = 8, 6, 64


def _admit(alloc: PageAllocator, rng: np.random.Generator):
    """B requests with 1..M pages each -> (block_tables [B, M] i32, expected [B, M] u32, num_pages [B] i32)."""
    bt = np.full((B, M), NULL_PAGE, np.int32)
    exp = np.zeros((B, M), np.uint32)
    n = rng.integers(1, M + 1, size=B).astype(np.int32)
    for b in range(B):
        for j, (p, t) in enumerate(alloc.allocate(int(n[b]))):
            bt[b, j], exp[b, j] = p, t
    return bt, exp, n


def test_fault_injection_flags_exactly_the_victims():
    rng = np.random.default_rng(0)
    trials, injected, caught = 200, 0, 0
    for _ in range(trials):
        alloc = PageAllocator(P)
        alloc.allocate(int(rng.integers(0, 8)))  # vary which ids requests get
        dev = alloc.device_tags()
        bt, exp, n = _admit(alloc, rng)
        dev = alloc.sync_device_tags(dev)
        assert np.asarray(check_tags(dev, jnp.asarray(bt), jnp.asarray(exp), jnp.asarray(n))).all()
        victims = rng.choice(B, size=int(rng.integers(1, 4)), replace=False)
        for v in victims:
            j = int(rng.integers(0, n[v]))
            page = int(bt[v, j])
            alloc.free(page, int(exp[v, j]))  # a bug frees a running request's page ...
            (p2, _), = alloc.allocate(1)  # ... and another request gets it (LIFO free list: same page)
            assert p2 == page
        # a few unrelated allocations after the faults: must not disturb the others
        alloc.allocate(int(rng.integers(0, 4)))
        dev = alloc.sync_device_tags(dev)
        ok = np.asarray(check_tags(dev, jnp.asarray(bt), jnp.asarray(exp), jnp.asarray(n)))
        want = np.ones(B, bool)
        want[victims] = False
        np.testing.assert_array_equal(ok, want)
        injected += len(victims)
        caught += int((~ok[victims]).sum())
    assert caught == injected  # 100% detection
    assert injected >= trials


def test_only_live_entries_count_and_bad_ids_fail():
    tags = jnp.arange(10, dtype=jnp.uint32) + 100
    bt = jnp.array([[1, 2, 3], [4, 5, 0], [4, 11, 0], [-1, 2, 3], [1, 2, 3]], jnp.int32)
    exp = jnp.array([[101, 102, 999], [104, 105, 7], [104, 0, 0], [99, 102, 103], [101, 102, 103]], jnp.uint32)
    n = jnp.array([2, 2, 2, 3, 4], jnp.int32)  # row 0: stale 3rd entry not live; row 4: claims more than M
    ok = np.asarray(check_tags(tags, bt, exp, n))
    np.testing.assert_array_equal(ok, [True, True, False, False, False])


def test_shared_prefix_page_survives_one_owner_freeing():
    alloc = PageAllocator(8)
    dev = alloc.device_tags()
    (p, t), = alloc.allocate(1)
    alloc.share(p, t)  # request B reuses A's prefix page
    alloc.free(p, t)  # A finishes
    alloc.allocate(3)  # other traffic: the shared page is not free, so not reallocated
    dev = alloc.sync_device_tags(dev)
    ok = check_tags(dev, jnp.array([[p]], jnp.int32), jnp.array([[t]], jnp.uint32), jnp.array([1], jnp.int32))
    assert bool(ok[0])


def test_mask_outputs_zeroes_failed_rows_bit_identical_elsewhere():
    x = jax.random.normal(jax.random.key(0), (5, 4, 8), jnp.float32).astype(jnp.bfloat16)
    x = x.at[1, 0, 0].set(jnp.nan)  # even NaN rows pass through unchanged when ok
    ok = jnp.array([True, True, False, True, False])
    y = np.asarray(mask_outputs(ok, x))
    xv = np.asarray(x)
    np.testing.assert_array_equal(y[[0, 1, 3]].view(np.uint16), xv[[0, 1, 3]].view(np.uint16))
    np.testing.assert_array_equal(y[[2, 4]].astype(np.float32), 0.0)


def test_disabled_switch_returns_all_true():
    tags = jnp.zeros((4,), jnp.uint32)
    bt = jnp.array([[1, 9], [2, 3]], jnp.int32)
    exp = jnp.array([[5, 5], [5, 5]], jnp.uint32)
    n = jnp.array([2, 2], jnp.int32)
    assert not np.asarray(check_tags(tags, bt, exp, n)).any()
    assert np.asarray(check_tags(tags, bt, exp, n, enabled=False)).all()


def test_integrity_errors_name_failed_requests():
    errs = integrity_errors(np.array([True, False, True, False]), ["a", "b", "c", "d"])
    assert [e.value for e in errs] == ["b", "d"] and all(isinstance(e, KVIntegrityError) for e in errs)
