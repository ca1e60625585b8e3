"""KV page integrity: the batched check, masking, the disabled switch; and device-side faults injected on every
read path of a running engine (prefill over prefix-cache pages, hand-off, decode, after preemption)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_util import engine, pool_is_full, prompts, tiny_model
from jaxserve.cache import NULL_PAGE, PageAllocator, write_tokens
from jaxserve.cache.integrity import check_tags, integrity_errors, mask_outputs
from jaxserve.engine import Request, SamplingParams
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


# ---- the engine: device-side faults on every read path --------------------------------------------------------
# A fault is a device-side write through a stale slot: `write_tokens` with the writer's old tag overwrites a page's
# contents (every layer) and stamps that tag, as a buggy request still holding the page's old mapping would. The
# host allocator is left alone, so only the device tags can reveal it.

ENGINE = dict(page_size=4, num_decode_pages=64, num_prefill_pages=64, max_batch=8, min_rows_bucket=8,
              max_prefill_tokens=64, prefill_chunk=8, min_chunk_bucket=8, max_model_len=64, kv_dtype="fp8")
GREEDY8 = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("deepseek_v3")


@pytest.fixture(scope="module")
def eng(model):
    return engine(model, **ENGINE)


def stray_write(programs, phase: str, page: int, tag: int, seed: int = 0) -> None:
    """Overwrite every layer of `page` through its slots, stamping `tag` (a stale writer's) - on the device."""
    ph = programs.prefill_phase if phase == "prefill" else programs.decode_phase
    pages, lay = ph.pages, ph.pages.layout
    ps = lay.page_size
    slots = jnp.arange(page * ps, (page + 1) * ps, dtype=jnp.int32)
    rows = jax.random.normal(jax.random.key(seed), (ps, lay.latent_dim), jnp.float32) * 3
    for layer in range(lay.num_layers):
        pages = write_tokens(pages, layer, rows, slots, jnp.full((ps,), tag, jnp.uint32))
    ph.pages = pages


def stale(tag: int) -> int:
    return (tag - 1) & 0xFFFFFFFF  # the page's previous generation (0 for a first allocation)


def run(e, reqs, inject=None) -> dict[str, tuple[list[int], object]]:
    """Submit reqs, step the synchronous engine to the end (calling inject(step) before each step) ->
    {request_id: (token ids, finish event)}."""
    streams = {r.request_id: e.submit(r) for r in reqs}
    i = 0
    while e.scheduler.has_work():
        if inject is not None:
            inject(i)
        e.step()
        i += 1
    out = {}
    for rid, stream in streams.items():
        evs = list(stream)
        out[rid] = ([ev.token_id for ev in evs if ev.token_id is not None], evs[-1])
    return out


def fresh(ps: list[list[int]], params: SamplingParams = GREEDY8) -> list[Request]:
    return [Request(list(p), params) for p in ps]


def assert_contained(e, got, clean, victims: set[str], clean_ids: list[str]) -> None:
    """Exactly the victims failed with KVIntegrityError; everyone else's tokens equal the clean run's."""
    for (rid, (toks, end)), cid in zip(got.items(), clean_ids):
        if rid in victims:
            assert end.finish_reason == "error" and isinstance(end.error, KVIntegrityError), (rid, end)
            assert end.error.value == rid
        else:
            assert end.finish_reason == "length" and end.error is None, (rid, end)
            assert toks == clean[cid][0], rid
    if e.scheduler.prefix_cache is not None:
        e.scheduler.prefix_cache.clear()
    assert pool_is_full(e) and e.stats()["prefill_pages_used"] == 0


def test_decode_read_of_an_overwritten_page_fails_only_its_owner(eng):
    ps = prompts(4, seed=20, lengths=(9, 14, 6, 11))
    clean_reqs = fresh(ps)
    clean = run(eng, clean_reqs)
    assert all(end.finish_reason == "length" for _, end in clean.values())
    eng.scheduler.prefix_cache.clear()
    reqs = fresh(ps)
    before = eng.stats()["tag_mismatches"]
    done = []

    def inject(step):
        victim = next((s for s in eng.scheduler.running if s.req.request_id == reqs[1].request_id
                       and len(s.generated) >= 3), None)
        if victim is not None and not done:
            page, tag = victim.decode_pages[0]
            stray_write(eng.programs, "decode", page, stale(tag))
            done.append(eng.scheduler._inflight is not None)

    got = run(eng, reqs, inject)
    # no token after the overwrite; a decode already in flight (EngineConfig.overlap) read the page before it
    assert done and len(got[reqs[1].request_id][0]) == 3 + done[0]
    assert_contained(eng, got, clean, {reqs[1].request_id}, [r.request_id for r in clean_reqs])
    assert eng.stats()["tag_mismatches"] == before + 1


def test_tags_only_overwrite_is_caught_too(eng):
    ps = prompts(2, seed=21, lengths=(7, 10))
    clean_reqs = fresh(ps)
    clean = run(eng, clean_reqs)
    eng.scheduler.prefix_cache.clear()
    reqs = fresh(ps)
    done = []

    def inject(step):
        victim = next((s for s in eng.scheduler.running if s.req.request_id == reqs[0].request_id
                       and s.generated), None)
        if victim is not None and not done:
            page, tag = victim.decode_pages[-1]
            ph = eng.programs.decode_phase
            ph.pages = dataclasses.replace(ph.pages, tags=ph.pages.tags.at[page].set(tag + 7))
            done.append(page)

    got = run(eng, reqs, inject)
    assert done
    assert_contained(eng, got, clean, {reqs[0].request_id}, [r.request_id for r in clean_reqs])


def test_prefill_over_an_overwritten_prefix_cache_page(eng):
    """B reuses A's cached prefix and prefills the rest in two chunks; between them a stale writer overwrites a
    cached page B reads. B fails at its second chunk having read nothing; the entry is dropped, so a later request
    with the same prefix recomputes it and gets the clean tokens; C and D are untouched."""
    rng = np.random.default_rng(22)
    prefix = list(map(int, rng.integers(0, 256, 20)))
    b_prompt = prefix + list(map(int, rng.integers(0, 256, 12)))  # 5 cached pages, then 12 tokens: 2 chunks
    others = prompts(2, seed=23, lengths=(9, 13))
    hit = []

    def after_prefix_cached(inject_into=None):
        eng.scheduler.prefix_cache.clear()
        run(eng, fresh([prefix]))
        reqs = fresh([b_prompt] + others)

        def inject(step):
            b = next((s for s in eng.scheduler.running if s.req.request_id == reqs[0].request_id), None)
            if b is not None and not hit and 20 < b.computed < b.target:
                page, tag = b.prefill_pages[1]  # a prefix-cache page, shared by B and the cache
                assert eng.scheduler.prefill_alloc.refcount(page) >= 2
                stray_write(eng.programs, "prefill", page, stale(tag))
                hit.append((page, tag))

        return reqs, run(eng, reqs, inject if inject_into else None)

    clean_reqs, clean = after_prefix_cached()
    assert clean[clean_reqs[0].request_id][1].cached_tokens == 20
    reqs, got = after_prefix_cached(inject_into=True)
    assert hit
    assert not got[reqs[0].request_id][0]  # B emitted nothing
    assert hit[0] not in {(e.page, e.tag) for e in eng.scheduler.prefix_cache.entries.values()}
    again = run(eng, fresh([b_prompt]))  # the same prefix again: the dropped page is recomputed, not reused
    assert list(again.values())[0][0] == clean[clean_reqs[0].request_id][0]
    assert_contained(eng, got, clean, {reqs[0].request_id}, [r.request_id for r in clean_reqs])


def test_prefix_cache_page_recycled_under_a_prefilling_request(eng):
    """The issue's case, host side: B prefills over a cached page; a bookkeeping bug drops both references to it,
    and C is handed the page and writes its own KV there (its allocation and its writes stamp C's tag). B fails
    at its next chunk instead of reading C's KV; the stale cache entry is dropped instead of raising inside the
    step; C and D finish with their clean tokens and every page comes back."""
    rng = np.random.default_rng(26)
    prefix = list(map(int, rng.integers(0, 256, 20)))
    b_prompt = prefix + list(map(int, rng.integers(0, 256, 12)))
    c_prompt, d_prompt = prompts(2, seed=27, lengths=(6, 10))
    clean = {tuple(p): run(eng, fresh([p])).popitem()[1][0] for p in (c_prompt, d_prompt)}
    eng.scheduler.prefix_cache.clear()
    run(eng, fresh([prefix]))
    b_req, d_req = fresh([b_prompt, d_prompt])
    c_req = fresh([c_prompt])[0]
    sched, hit, streams = eng.scheduler, [], {}

    def inject(step):
        b = next((s for s in sched.running if s.req.request_id == b_req.request_id), None)
        if b is not None and not hit and 20 < b.computed < b.target:
            page, tag = b.prefill_pages[2]
            sched.prefill_alloc.free(page, tag)  # B's reference ...
            sched.prefill_alloc.free(page, tag)  # ... and the cache's: the page is free while both still map it
            streams[c_req.request_id] = eng.submit(c_req)  # C is admitted this step and gets the page
            hit.append((page, tag))

    got = run(eng, [b_req, d_req], inject)
    c_events = list(streams[c_req.request_id])
    # C really was handed the page B and the cache still mapped: C's own first page is cached under C's tag
    assert hit and any(e.page == hit[0][0] and e.tag != hit[0][1] for e in sched.prefix_cache.entries.values())
    b_toks, b_end = got[b_req.request_id]
    assert not b_toks and isinstance(b_end.error, KVIntegrityError)
    assert [ev.token_id for ev in c_events if ev.token_id is not None] == clean[tuple(c_prompt)]
    assert c_events[-1].finish_reason == "length"
    assert got[d_req.request_id][0] == clean[tuple(d_prompt)] and got[d_req.request_id][1].finish_reason == "length"
    assert hit[0] not in {(e.page, e.tag) for e in sched.prefix_cache.entries.values()}
    sched.prefix_cache.clear()
    assert pool_is_full(eng) and eng.stats()["prefill_pages_used"] == 0


def test_handoff_of_an_overwritten_page_is_verified_on_the_decode_side(eng):
    ps = prompts(3, seed=24, lengths=(10, 7, 13))
    clean_reqs = fresh(ps)
    clean = run(eng, clean_reqs)
    eng.scheduler.prefix_cache.clear()
    reqs = fresh(ps)
    real = eng.programs.handoff
    hit, shared = [], []

    def hooked(src, dst, src_tags, dst_tags, groups=None):
        victim = next((s for s in eng.scheduler.running if s.req.request_id == reqs[2].request_id), None)
        mine = [p for p, _ in victim.prefill_pages] if victim is not None else []
        if mine and not hit and set(mine) <= set(src):  # the hand-off may carry the other requests too
            i = list(src).index(mine[1])
            stray_write(eng.programs, "prefill", src[i], stale(src_tags[i]))  # races the transfer
            hit.append((src[i], src_tags[i]))
            shared.append(len([p for p, d in zip(src, dst) if d >= 0]) > len(mine))
        return real(src, dst, src_tags, dst_tags, groups)

    eng.programs.handoff = hooked
    try:
        got = run(eng, reqs)
    finally:
        eng.programs.handoff = real
    assert hit and shared == [True]  # the hand-off carried the other requests' pages too: they must be unharmed
    assert len(got[reqs[2].request_id][0]) <= 1  # at most the first token, sampled by prefill before the fault
    assert hit[0] not in {(e.page, e.tag) for e in eng.scheduler.prefix_cache.entries.values()}  # dropped
    assert_contained(eng, got, clean, {reqs[2].request_id}, [r.request_id for r in clean_reqs])


def test_stale_write_after_preemption_fails_the_pages_new_owner(model):
    """A tiny decode pool forces preemption; the preempted request's old mapping then writes into a page that now
    belongs to another request: exactly that owner fails; the preempted request recomputes and, like everyone
    else, matches the clean run."""
    e = engine(model, **{**ENGINE, "num_decode_pages": 17, "prefix_cache": False, "kv_dtype": "bf16",
                         "deterministic": False})  # the deterministic default never preempts
    ps = prompts(4, seed=25, lengths=(11, 9, 13, 10))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    clean_reqs = fresh(ps, params)
    clean = run(e, clean_reqs)
    assert e.stats()["preemptions"] > 0
    reqs = fresh(ps, params)
    sched = e.scheduler
    released: list[tuple[int, int]] = []
    real_preempt = sched._preempt

    def preempt(seq):
        released.extend(seq.decode_pages)
        real_preempt(seq)

    sched._preempt = preempt
    hit = []

    def inject(step):
        if hit:
            return
        for s in sched.running:
            for page, tag in s.decode_pages:
                old = next((t for p, t in released if p == page and t != tag), None)
                if old is not None and s.generated:
                    stray_write(e.programs, "decode", page, old)
                    hit.append(s.req.request_id)
                    return

    try:
        got = run(e, reqs, inject)
    finally:
        del sched._preempt
    assert hit and released
    assert_contained(e, got, clean, set(hit), [r.request_id for r in clean_reqs])


# ---- a failed row reads nothing, on every attention path ------------------------------------------------------
# (module attribute of jaxserve.models.attention_backend, index of the block-table argument; lengths follow it)
KERNELS = (("paged_mla_decode", 2), ("paged_mla_decode_tpu", 2), ("paged_gqa_decode", 3),
           ("paged_gqa_decode_tpu", 3), ("paged_attention_xla.mla_decode", 3), ("paged_attention_xla.gqa_decode", 5))


def _two_row_pool(model, kv_dtype: str, victim_tag: int):
    """A pool with row 0 on pages [1, 2] (tags 5, 6) and row 1 on pages [3, 4] (tags 7, 8), KV written through
    write_tokens with those tags, then page 4 rewritten by a writer with `victim_tag`. -> (pages, DecodeBatch)."""
    from jaxserve.cache import init_pages
    from jaxserve.engine.layouts import kv_layout
    from jaxserve.models.paged import DecodeBatch

    cfg = model.cfg
    lay = kv_layout(cfg, 4, kv_dtype)
    pages = init_pages(lay, 8)
    slots = jnp.arange(4, 20, dtype=jnp.int32)  # pages 1..4
    tags = jnp.repeat(jnp.array([5, 6, 7, 8], jnp.uint32), 4)
    key = jax.random.key(3)
    for layer in range(lay.num_layers):
        key, k1, k2 = jax.random.split(key, 3)
        if lay.kind == "mla":
            rows = jax.random.normal(k1, (16, lay.latent_dim))
        else:
            rows = (jax.random.normal(k1, (16, lay.kv_heads, lay.head_dim)),
                    jax.random.normal(k2, (16, lay.kv_heads, lay.head_dim)))
        pages = write_tokens(pages, layer, rows, slots, tags)
        page4 = jnp.arange(16, 20, dtype=jnp.int32)
        rows4 = jax.tree.map(lambda r: r[:4] * -2.0, rows)
        pages = write_tokens(pages, layer, rows4, page4, jnp.full((4,), victim_tag, jnp.uint32))
    bt = jnp.array([[1, 2, 0], [3, 4, 0]], jnp.int32)
    batch = DecodeBatch(tokens=jnp.array([11, 12], jnp.int32), positions=jnp.array([6, 7], jnp.int32),
                        slots=jnp.array([2 * 4 + 2, 4 * 4 + 3], jnp.int32), block_tables=bt,
                        lengths=jnp.array([7, 8], jnp.int32), expected_tags=jnp.array([[5, 6, 0], [7, 8, 0]],
                                                                                        jnp.uint32),
                        num_pages=jnp.array([2, 2], jnp.int32))
    return pages, batch


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("impl", ["xla", "pallas_interpret", "pallas_tpu_interpret"])
def test_failed_row_reaches_no_kernel_with_its_pages(monkeypatch, arch, impl):
    """Row 1's page 4 was rewritten by a stale writer (device tag 9, expected 8). The kernel of every attention
    path receives row 1 as the null page with length 0, writes nothing for it, and row 0's logits equal those of
    a run where nothing went wrong."""
    import jaxserve.models.attention_backend as backends
    import jaxserve.models.paged as paged

    model = _MODELS.setdefault(arch, tiny_model(arch))
    seen = []

    def spy(real, at: int):  # records (block tables, lengths) as the kernel receives them
        def wrapped(*args, **kwargs):
            seen.append((args[at], args[at + 1]))
            return real(*args, **kwargs)
        return wrapped

    for name, at in KERNELS:
        owner, attr = (backends.paged_attention_xla, name.split(".")[1]) if "." in name else (backends, name)
        monkeypatch.setattr(owner, attr, spy(getattr(owner, attr), at))
    kv = "fp8"
    pages, batch = _two_row_pool(model, kv, victim_tag=9)
    before = pages
    attention = backends.AttentionBackend.parse(impl)
    logits, after, ok = paged.decode(model, pages, batch, integrity=True, attention=attention)
    np.testing.assert_array_equal(np.asarray(ok), [True, False])
    assert len(seen) == model.cfg.num_layers
    for bt, lengths in seen:
        np.testing.assert_array_equal(np.asarray(bt)[1], NULL_PAGE)
        np.testing.assert_array_equal(np.asarray(bt)[0], [1, 2, 0])
        assert int(lengths[1]) == 0
    field = "latent" if after.layout.kind == "mla" else "k"
    np.testing.assert_array_equal(np.asarray(getattr(after, field)[:, 4]), np.asarray(getattr(before, field)[:, 4]))
    assert int(after.tags[4]) == 9 and int(after.tags[2]) == 6
    clean_pages, _ = _two_row_pool(model, kv, victim_tag=8)
    clean_logits, _, clean_ok = paged.decode(model, clean_pages, batch, integrity=True, attention=attention)
    assert np.asarray(clean_ok).all()
    np.testing.assert_array_equal(np.asarray(logits)[0], np.asarray(clean_logits)[0])


_MODELS: dict = {}


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_failed_prefill_row_reads_and_writes_nothing(arch):
    """A prefill chunk whose context holds an overwritten page: zero logits, no KV written, ok False; the other
    row's logits equal a clean run's."""
    from jaxserve.models.paged import PrefillBatch, prefill

    model = _MODELS.setdefault(arch, tiny_model(arch))
    pages, _ = _two_row_pool(model, "bf16", victim_tag=9)
    batch = PrefillBatch(tokens=jnp.array([[3, 4], [5, 6]], jnp.int32), positions=jnp.array([[5, 6], [6, 7]]),
                         slots=jnp.array([[9, 10], [18, 19]], jnp.int32), block_tables=jnp.array([[1, 2], [3, 4]]),
                         ctx_lens=jnp.array([7, 8], jnp.int32), chunk_lens=jnp.array([2, 2], jnp.int32),
                         expected_tags=jnp.array([[5, 6], [7, 8]], jnp.uint32), num_pages=jnp.array([2, 2]))
    logits, after, ok = prefill(model, pages, batch)
    np.testing.assert_array_equal(np.asarray(ok), [True, False])
    np.testing.assert_array_equal(np.asarray(logits)[1], 0.0)
    field = "latent" if after.layout.kind == "mla" else "k"
    np.testing.assert_array_equal(np.asarray(getattr(after, field)[:, 4]), np.asarray(getattr(pages, field)[:, 4]))
    clean, _ = _two_row_pool(model, "bf16", victim_tag=8)
    clean_logits, _, clean_ok = prefill(model, clean, batch)
    assert np.asarray(clean_ok).all()
    np.testing.assert_array_equal(np.asarray(logits)[0], np.asarray(clean_logits)[0])


def test_handoff_chunk_tags_are_verified_on_the_decode_side():
    """insert_pages writes a chunk whose carried tags match the host's and stamps the destination tags; a chunk
    with one overwritten page writes nothing and stamps 0 (the owner's first decode check fails)."""
    from jaxserve.cache import KVLayout, init_pages, insert_pages, pages_to_fp8

    lay = KVLayout.mla(2, 8, 4, page_size=4)
    src = init_pages(lay, 6)
    rows = jax.random.normal(jax.random.key(1), (8, 12))
    for layer in range(2):
        src = write_tokens(src, layer, rows, jnp.arange(4, 12, dtype=jnp.int32), jnp.repeat(jnp.array([3, 4],
                                                                                                       jnp.uint32), 4))
    dst = init_pages(lay.with_dtype("fp8"), 6)
    chunk = pages_to_fp8(src, jnp.array([1, 2, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(chunk.tags), [3, 4, 0])
    ids, new = jnp.array([5, 3, -1], jnp.int32), jnp.array([21, 22, 0], jnp.uint32)
    good = insert_pages(dst, chunk, ids, jnp.array([3, 4, 0], jnp.uint32), new)
    np.testing.assert_array_equal(np.asarray(good.tags), [0, 0, 0, 22, 0, 21])
    np.testing.assert_array_equal(np.asarray(good.latent[:, 5]), np.asarray(chunk.latent[:, 0]))
    bad = insert_pages(dst, chunk, ids, jnp.array([3, 5, 0], jnp.uint32), new)  # page 2 no longer holds tag 5
    np.testing.assert_array_equal(np.asarray(bad.tags), 0)
    np.testing.assert_array_equal(np.asarray(bad.latent), np.asarray(dst.latent))
    # two requests in one hand-off (groups 0 and 1): the mismatch fails request 1 only
    two = insert_pages(dst, chunk, ids, jnp.array([3, 5, 0], jnp.uint32), new, jnp.array([0, 1, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(two.tags), [0, 0, 0, 0, 0, 21])
    np.testing.assert_array_equal(np.asarray(two.latent[:, 5]), np.asarray(chunk.latent[:, 0]))
    np.testing.assert_array_equal(np.asarray(two.latent[:, 3]), np.asarray(dst.latent[:, 3]))
