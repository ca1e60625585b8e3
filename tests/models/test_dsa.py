"""GLM-5.x DeepSeek Sparse Attention over paged KV: the indexer key cache in the page pools, top-k selection over
pages, sparse attention over the selected latent rows, IndexShare, against transformers' glm_moe_dsa (float32,
eager, full sequence, no cache) on a tiny random model with index_topk 8 and prompts of 64-200 tokens.

The tiny model's indexer has 16 heads: a key whose ReLU scores are 0 on every head scores exactly 0, and with 4
heads (1 key in 16) such exact ties often straddle the top-k boundary, where transformers' torch.topk and
lax.top_k may keep different (equally valid) keys; with 16 heads they are about 1 in 65,000.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import hf_tiny
import jaxserve
from engine_util import pool_is_full
from jaxserve.cache import (KVLayout, gather_index_keys, init_pages, insert_pages, pages_to_fp8, quantize_fp8,
                            write_index_keys)
from jaxserve.config import from_hf_config
from jaxserve.convert.converter import convert
from jaxserve.engine import Engine, EngineConfig, Request, SamplingParams
from jaxserve.engine.layouts import kv_layout
from jaxserve.errors import KVIntegrityError
from jaxserve.eval import quality
from jaxserve.models import dsa
from jaxserve.models.attention import index_scores
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.paged import DecodeBatch, PrefillBatch, decode, prefill

TOPK = 8
TYPES = ("full", "shared", "full")  # IndexShare: layer 1 reuses layer 0's selection; layer 2 is indexer cache layer 1
PS = 8  # page size


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, jaxserve config, jaxserve model) of one tiny glm_moe_dsa, through the real converter."""
    root = tmp_path_factory.mktemp("dsa")
    hf = hf_tiny.build("glm_moe_dsa", index_topk=TOPK, indexer_types=TYPES, index_n_heads=16)
    hf_tiny.save(hf, root / "hf")
    convert(root / "hf", root / "jx", dtype="float32", progress=False)
    cfg, model = jaxserve.load(root / "jx")
    assert cfg.index_topk == TOPK and cfg.index_layers == (0, 2)
    return hf, cfg, model


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _hf_logits(hf, tokens: list[int]) -> np.ndarray:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: intra-op threads only contend (10x slower on a loaded 2-core host)
    try:
        with torch.no_grad():
            return hf(input_ids=torch.tensor([tokens])).logits[0].numpy()
    finally:
        torch.set_num_threads(threads)


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decoding by the full-sequence forward (no cache: every step sees the whole text)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_hf_logits(hf, seq)[-1].argmax()))
    return seq[len(prompt):]


# ---- config ------------------------------------------------------------------------------------------------------
def test_glm52_real_config_rope_indexshare_and_mtp():
    """GLM-5.2's config.json as shipped: nested rope_parameters (theta 8e6), a misleading head_dim 192 (the rope dim
    is qk_rope_head_dim 64), IndexShare freq 4 / offset 3 (21 full indexers: 0, 1, 2, then every 4th), one MTP
    layer that is not a main layer (its own indexer keys come after the main layers')."""
    from jaxserve.plan import PRESETS

    raw = dict(PRESETS["glm-5.2"])
    cfg = from_hf_config(raw)
    assert cfg.rope.theta == 8e6 and cfg.rope.rope_type == "default" and cfg.rope_dim == 64
    assert cfg.max_position_embeddings == 1048576 and cfg.num_layers == 78
    assert cfg.index_layers == (0, 1, 2, *range(6, 78, 4)) and len(cfg.index_layers) == 21
    assert cfg.mtp_layers == 1 and cfg.index_cache_layers == 22 and cfg.index_slot(78) == 21
    # the explicit indexer_types list (78 entries) gives the same schedule as freq/offset
    assert from_hf_config({**raw, "indexer_types": list(cfg.indexer_types)}).index_layers == cfg.index_layers
    with pytest.raises(jaxserve.errors.ConfigError, match="indexer_types"):
        from_hf_config({**raw, "indexer_types": ["full"] * 10})


def test_bytes_per_token_include_the_indexer_keys():
    cfg = from_hf_config(__import__("jaxserve.plan", fromlist=["PRESETS"]).PRESETS["glm-5.2"])
    fp8, bf16 = kv_layout(cfg, 64, "fp8"), kv_layout(cfg, 64, "bf16")
    # 78 layers + the MTP layer (its latent rows and its own indexer keys), 21 full indexers + the MTP layer's
    assert fp8.bytes_per_token() == 79 * (576 + 4) + 22 * (128 + 4)
    assert bf16.bytes_per_token() == 79 * 576 * 2 + 22 * 128 * 2
    assert kv_layout(cfg, 64, "fp8", "bf16").bytes_per_token() == 79 * (576 + 4) + 22 * 128 * 2
    for lay in (fp8, bf16):  # the real pool's KV arrays hold exactly that (its per-page tags are not per token)
        shapes = dataclasses.replace(jax.eval_shape(lambda: init_pages(lay, 2)), tags=None)
        assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)) == 2 * 64 * lay.bytes_per_token()


# ---- pages -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_index_keys_write_gather_and_hand_off(dtype):
    lay = KVLayout.mla(3, 16, 8, page_size=4, dtype="bf16", index_layers=2, index_head_dim=16)
    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.normal(size=(10, 16)), jnp.float32)
    slots = jnp.asarray([4 * 2 + i for i in range(4)] + [4 * 5 + i for i in range(4)] + [4 * 3, -1], jnp.int32)
    src = write_index_keys(init_pages(lay, 8), 1, keys, slots)
    got = gather_index_keys(src, 1, jnp.asarray([[2, 5, 3]], jnp.int32))[0, :9]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(keys[:9].astype(jnp.bfloat16).astype(jnp.float32)))
    # the BF16 -> decode hand-off carries the keys: FP8 (+ scale) equals writing FP8 keys directly
    dst_lay = KVLayout.mla(3, 16, 8, page_size=4, dtype="fp8", index_layers=2, index_head_dim=16,
                           index_dtype=None if dtype == "fp8" else "bf16")  # FP8 keys, or the BF16 option
    chunk = pages_to_fp8(src, jnp.asarray([2, 5, 3], jnp.int32), dst_lay.index_dtype)
    dst = insert_pages(init_pages(dst_lay, 8), chunk, jnp.asarray([1, 6, 7], jnp.int32))
    moved = gather_index_keys(dst, 1, jnp.asarray([[1, 6, 7]], jnp.int32))[0, :9]
    bf = keys[:9].astype(jnp.bfloat16).astype(jnp.float32)
    if dtype == "fp8":
        q, s = quantize_fp8(bf)
        np.testing.assert_array_equal(np.asarray(moved), np.asarray(q.astype(jnp.float32) * s[:, None]))
        assert dst.index_k.dtype == jnp.uint8 and dst.index_k_scale is not None
    else:
        np.testing.assert_array_equal(np.asarray(moved), np.asarray(bf))
        assert dst.index_k.dtype == jnp.uint16 and dst.index_k_scale is None
    # layer 0 of the indexer cache was never written
    assert not np.asarray(gather_index_keys(dst, 0, jnp.asarray([[1, 6, 7]], jnp.int32))).any()


def test_blockwise_topk_equals_one_shot_topk():
    """The running top-k over page blocks selects what one top_k over the row's causal scores selects."""
    rng = np.random.default_rng(1)
    B, T, nh, hd, M, ps = 2, 5, 4, 16, 16, 4
    lay = KVLayout.mla(1, 8, 8, page_size=ps, dtype="f32", index_layers=1, index_head_dim=hd)
    keys = jnp.asarray(rng.normal(size=(B * M * ps, hd)), jnp.float32)
    bt = jnp.asarray(rng.permutation(np.arange(1, 1 + B * M)).reshape(B, M), jnp.int32)
    slots = (bt[:, :, None] * ps + jnp.arange(ps)).reshape(-1)
    pages = write_index_keys(init_pages(lay, 1 + B * M), 0, keys, slots)
    q = jnp.asarray(rng.normal(size=(B, T, nh, hd)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(B, T, nh)), jnp.float32)
    ctx = jnp.asarray([40, 7], jnp.int32)
    pos = ctx[:, None] - T + jnp.arange(T)[None]
    s = index_scores(q, w, keys.reshape(B, M * ps, hd))
    kpos = jnp.arange(M * ps)
    s = jnp.where((kpos <= pos[..., None]) & (kpos < ctx[:, None, None]), s, -jnp.inf)
    for block in (4, 16, 64):
        idx, valid = dsa.select_topk(q, w, pages, 0, bt, pos, ctx, TOPK, block_tokens=block)
        idx, valid = np.asarray(idx), np.asarray(valid)
        for b in range(B):
            for t in range(T):
                n_ok = min(TOPK, int(pos[b, t]) + 1)  # a short context selects all its keys, nothing else
                assert valid[b, t].sum() == n_ok
                want = np.sort(np.asarray(jax.lax.top_k(s[b, t], n_ok)[1]))
                np.testing.assert_array_equal(np.sort(idx[b, t][valid[b, t]]), want)


def test_sparse_prefill_blockwise_over_queries_equals_one_shot_and_shrinks_the_gathered_rows():
    """`dsa.attend` over query blocks of 4 gives what one block of all T queries gives (same selection, outputs
    within f32 rounding), and its compiled temporaries (XLA:CPU's memory_analysis) drop below the one-shot
    program's [B, T, K, r + dr] f32 gathered rows."""
    rng = np.random.default_rng(2)
    B, T, N, r, dr, nh, hd, M, ps, K = 2, 32, 4, 48, 16, 4, 16, 16, 4, 16
    lay = KVLayout.mla(2, r, dr, page_size=ps, dtype="bf16", index_layers=1, index_head_dim=hd)
    bt = jnp.asarray(rng.permutation(np.arange(1, 1 + B * M)).reshape(B, M), jnp.int32)
    slots = (bt[:, :, None] * ps + jnp.arange(ps)).reshape(-1)
    pages = init_pages(lay, 1 + B * M)
    pages = write_index_keys(pages, 0, jnp.asarray(rng.normal(size=(B * M * ps, hd)), jnp.float32), slots)
    pages = jaxserve.cache.write_tokens(pages, 1, jnp.asarray(rng.normal(size=(B * M * ps, r + dr)), jnp.float32),
                                        slots)
    ctx = jnp.asarray([M * ps, 40], jnp.int32)
    tables = (bt, ctx[:, None] - T + jnp.arange(T)[None], ctx)
    q = jnp.asarray(rng.normal(size=(B, T, N, r + dr)), jnp.float32)
    index_q = (jnp.asarray(rng.normal(size=(B, T, nh, hd)), jnp.float32),
               jnp.asarray(rng.normal(size=(B, T, nh)), jnp.float32))

    def run(block: int):
        fn = jax.jit(lambda q, iq, pages, tables: dsa.attend(q, iq, None, pages, 1, 0, tables, topk=K,
                                                             softmax_scale=0.1, block=block))
        args = (q, index_q, pages, tables)
        return fn(*args), fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

    (o_all, sel_all), temp_all = run(T)
    (o_blk, sel_blk), temp_blk = run(4)
    np.testing.assert_array_equal(np.asarray(sel_blk[0]), np.asarray(sel_all[0]))
    np.testing.assert_array_equal(np.asarray(sel_blk[1]), np.asarray(sel_all[1]))
    np.testing.assert_allclose(np.asarray(o_blk), np.asarray(o_all), rtol=1e-6, atol=1e-6)
    rows = B * T * K * (r + dr) * 4
    print(f"\ntemporaries: one block of {T} queries {temp_all:,} B, blocks of 4 {temp_blk:,} B (rows {rows:,} B)")
    assert temp_all >= rows > temp_blk


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_decode_attend_by_the_sparse_kernel_equals_the_xla_path(kv):
    """`dsa.attend` for one query per row under attention="pallas_interpret" (the indexer scores and sparse MLA
    decode kernels over the whole pool, layer 1 of 2) and "pallas_tpu_interpret" (their Mosaic counterparts)
    gives the XLA path's selection and outputs (within f32 rounding), rows whose context fills the top-k and one
    that leaves slots invalid; the kernels' scores in the blockwise top-k (4 blocks of 8 tokens) select the
    same."""
    rng = np.random.default_rng(3)
    B, N, r, dr, nh, hd, M, ps, K = 3, 4, 32, 16, 4, 16, 8, 4, 16
    lay = KVLayout.mla(2, r, dr, page_size=ps, dtype=kv, index_layers=1, index_head_dim=hd)
    bt = jnp.asarray(rng.permutation(np.arange(1, 1 + B * M)).reshape(B, M), jnp.int32)
    slots = (bt[:, :, None] * ps + jnp.arange(ps)).reshape(-1)
    pages = write_index_keys(init_pages(lay, 1 + B * M), 0, jnp.asarray(rng.normal(size=(B * M * ps, hd))), slots)
    for layer in (0, 1):
        rows = jnp.asarray(rng.normal(size=(B * M * ps, r + dr)), jnp.float32)
        pages = jaxserve.cache.write_tokens(pages, layer, rows, slots)
    ctx = jnp.asarray([M * ps, 21, 9], jnp.int32)  # the last row's 9 tokens leave 7 of 16 slots invalid
    tables = (bt, ctx[:, None] - 1, ctx)
    q = jnp.asarray(rng.normal(size=(B, 1, N, r + dr)), jnp.float32)
    index_q = (jnp.asarray(rng.normal(size=(B, 1, nh, hd)), jnp.float32),
               jnp.asarray(rng.normal(size=(B, 1, nh)), jnp.float32))
    out = {name: jax.jit(lambda q, iq, pages, tables, a=AttentionBackend.parse(name): dsa.attend(
        q, iq, None, pages, 1, 0, tables, topk=K, softmax_scale=0.1, attention=a))(q, index_q, pages, tables)
        for name in ("xla", "pallas_interpret", "pallas_tpu_interpret")}
    (o_x, (i_x, v_x)), *kernels = out.values()
    assert not np.asarray(v_x)[2].all()
    for o_k, (i_k, v_k) in kernels:
        np.testing.assert_array_equal(np.asarray(i_k), np.asarray(i_x))
        np.testing.assert_array_equal(np.asarray(v_k), np.asarray(v_x))
        np.testing.assert_allclose(np.asarray(o_k), np.asarray(o_x), rtol=1e-5, atol=1e-5)
    for name in ("pallas_interpret", "pallas_tpu_interpret"):
        i_b, v_b = dsa.select_topk(*index_q, pages, 0, bt, tables[1], ctx, K, block_tokens=8,
                                   attention=AttentionBackend.parse(name))
        np.testing.assert_array_equal(np.asarray(v_b), np.asarray(v_x))  # invalid slots' indices are don't-cares
        np.testing.assert_array_equal(np.where(v_b, i_b, -1), np.where(v_x, i_x, -1))


# ---- the model over pages against transformers -------------------------------------------------------------------
@nnx.jit(static_argnames=("all_logits",))
def _prefill(model, pages, batch, all_logits):
    return prefill(model, pages, batch, all_logits=all_logits)


@nnx.jit
def _decode(model, pages, batch):
    return decode(model, pages, batch, integrity=False, attention=AttentionBackend("xla"))


def _prefill_row(model, pages, prompt: list[int], bt: jax.Array, chunk: int = 32) -> tuple[list, object]:
    """Chunked prefill of one row (table bt [1, M]) -> (each prompt position's logits [V], pages)."""
    slot = lambda p: int(bt[0, p // PS]) * PS + p % PS  # noqa: E731
    got, n = [], len(prompt)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        pos = np.arange(c0, c0 + chunk, dtype=np.int32)
        toks = np.zeros(chunk, np.int32)
        toks[: c1 - c0] = prompt[c0:c1]
        slots = np.asarray([slot(p) if p < c1 else -1 for p in pos], np.int32)
        batch = PrefillBatch(jnp.asarray(toks[None]), jnp.asarray(pos[None]), jnp.asarray(slots[None]), bt,
                             jnp.asarray([c1], jnp.int32), jnp.asarray([c1 - c0], jnp.int32))
        logits, pages, _ = _prefill(model, pages, batch, True)
        got.extend(np.asarray(logits)[0, : c1 - c0])
    return got, pages


@pytest.mark.parametrize("n_prompt,n_pages", [(150, 32), pytest.param(6, 1, marks=pytest.mark.slow)],
                         ids=["sparse", "dense-within-topk"])
def test_paged_logits_match_transformers_at_every_position(tiny, n_prompt, n_pages):
    """Chunked prefill (32-token chunks) and decode over an f32 pool whose pages are scattered: logits within 1e-4
    (of the logit scale) of transformers' full-sequence logits at every prompt and generated position. 150 tokens
    over 32 pages of 8 runs the sparse path (each query attends to its 8 selected tokens); 6 tokens over one page
    the dense path (a block table within index_topk)."""
    hf, cfg, model = tiny
    prompt = _prompt(n_prompt, seed=n_prompt)
    text = prompt + _hf_greedy(hf, prompt, 2)
    ref = _hf_logits(hf, text)
    pages = init_pages(kv_layout(cfg, PS, "f32"), 1 + 2 * n_pages)
    bt = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, 1 + 2 * n_pages))[:n_pages][None], jnp.int32)
    slot = lambda p: int(bt[0, p // PS]) * PS + p % PS  # noqa: E731
    got, pages = _prefill_row(model, pages, prompt, bt)
    for p in range(n_prompt, len(text)):
        batch = DecodeBatch(jnp.asarray([text[p]], jnp.int32), jnp.asarray([p], jnp.int32),
                            jnp.asarray([slot(p)], jnp.int32), bt, jnp.asarray([p + 1], jnp.int32),
                            jnp.zeros((1, n_pages), jnp.uint32), jnp.asarray([n_pages], jnp.int32))
        logits, pages, _ = _decode(model, pages, batch)
        got.append(np.asarray(logits)[0])
    got = np.stack(got)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.slow  # 30-40 s: test_decode_attend_by_the_sparse_kernel_equals_the_xla_path checks the same path cheaply
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_sparse_decode_kernel_greedy_equals_the_xla_path(tiny, kv):
    """Decode on the sparse path (block tables of 32 pages > index_topk 8) under attention="pallas_interpret" and
    "pallas_tpu_interpret" (the Triton / Mosaic sparse MLA decode kernel reads each row's top-k rows from the whole
    pool) and "xla" (gathered rows): two rows of different lengths, an FP8 or BF16 pool, 4 greedy steps each: the
    same tokens, logits close."""
    _, cfg, model = tiny
    n_pages, prompts = 32, [_prompt(100, seed=21), _prompt(150, seed=22)]
    pages = init_pages(kv_layout(cfg, PS, kv), 1 + 2 * n_pages)
    bt = jnp.asarray(np.random.default_rng(1).permutation(np.arange(1, 1 + 2 * n_pages)).reshape(2, n_pages),
                     jnp.int32)
    last = []
    for r, p in enumerate(prompts):
        logits, pages = _prefill_row(model, pages, p, bt[r:r + 1])
        last.append(int(np.argmax(logits[-1])))
    step = nnx.jit(lambda model, pages, batch, attention: decode(model, pages, batch, integrity=False,
                                                                 attention=attention), static_argnums=3)
    runs = {}
    for name in ("xla", "pallas_interpret", "pallas_tpu_interpret"):
        toks, pos, pool, seq, all_logits = list(last), [len(p) for p in prompts], pages, [], []
        for _ in range(4):
            slots = [int(bt[r, q // PS]) * PS + q % PS for r, q in enumerate(pos)]
            batch = DecodeBatch(jnp.asarray(toks, jnp.int32), jnp.asarray(pos, jnp.int32),
                                jnp.asarray(slots, jnp.int32), bt, jnp.asarray(pos, jnp.int32) + 1,
                                jnp.zeros((2, n_pages), jnp.uint32), jnp.full((2,), n_pages, jnp.int32))
            logits, pool, _ = step(model, pool, batch, AttentionBackend.parse(name))
            toks, pos = [int(t) for t in np.argmax(np.asarray(logits), -1)], [q + 1 for q in pos]
            seq.append(toks)
            all_logits.append(np.asarray(logits))
        runs[name] = (seq, np.stack(all_logits))
    (xla_seq, xla_logits), *kernels = runs.values()
    for kern_seq, kern_logits in kernels:
        assert kern_seq == xla_seq
        np.testing.assert_allclose(kern_logits, xla_logits, atol=1e-3 * np.abs(xla_logits).max())


# ---- the engine ----------------------------------------------------------------------------------------------------
def _engine(model, **overrides: object) -> Engine:
    """An f32 engine with one program per phase (rows 4, chunk 32, 32 pages of 8 = max_model_len 256 > index_topk)."""
    base = dict(kv_dtype="f32", prefill_weights="f32", decode_weights="f32", dtype="float32", page_size=PS,
                num_decode_pages=30, num_prefill_pages=96, max_batch=4, max_prefill_tokens=128, prefill_chunk=32,
                max_model_len=256, min_rows_bucket=4, min_pages_bucket=32, min_chunk_bucket=32, page_bucket_steps=1)
    base.update(overrides)
    return Engine(model, EngineConfig(**base), start=False)


@pytest.fixture(scope="module")
def eng(tiny):
    return _engine(tiny[2], deterministic=False)  # its workload preempts: the non-deterministic policy


def test_engine_greedy_equals_transformers_past_index_topk(tiny, eng):
    """max_model_len 256 > index_topk 8 is accepted, and requests of 64-200 tokens (each query attends to its 8
    selected tokens) decode exactly transformers' full-sequence greedy tokens, with chunked prefill (32-token
    chunks), a prefix-cache hit (the second request reuses the first's 16 full pages of a shared 128-token prefix)
    and preemption (two requests that start in 22 of the 29 decode pages and grow to 31)."""
    hf, cfg, model = tiny
    e = eng
    short, long = SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True)
    first = _prompt(200, seed=1)
    second = first[:128] + _prompt(20, seed=2)
    grow = [_prompt(64, seed=3), _prompt(100, seed=4)]
    outs = e.generate([first], short) + e.generate([second], short)
    assert outs[1].cached_tokens == 128
    outs += e.generate(grow, long)
    assert e.stats()["preemptions"] > 0
    for p, o in zip([first, second, *grow], outs):
        assert o.error is None and o.token_ids == _hf_greedy(hf, p, len(o.token_ids))
    assert [len(o.token_ids) for o in outs] == [8, 8, 40, 40]
    assert dict(e.programs.compiles) == {"prefill": 1, "decode": 1, "handoff": 1}
    assert pool_is_full(e)


def test_stale_page_aborts_only_that_request_on_the_sparse_path(eng):
    """The indexer keys share the latent rows' pages, so the page tags cover them: a request whose page is
    reallocated under it fails closed (its top-k reads nothing: length 0) and the others' tokens are unchanged."""
    e = eng
    ps = [_prompt(n, seed=10 + n) for n in (64, 70, 48)]  # 25 of the 29 decode pages: all three decode at once
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    clean = e.generate(ps, params)
    reqs = [Request(p, params) for p in ps]
    streams = [e.submit(r) for r in reqs]
    sched = e.scheduler
    for _ in range(64):
        if sum(s.status.value == "decoding" for s in sched.running) == 3:
            break
        e.step()
    victim = next(s for s in sched.running if s.req.request_id == reqs[1].request_id)
    page, tag = victim.decode_pages[0]
    sched.decode_alloc.free(page, tag)
    [(new_page, new_tag)] = sched.decode_alloc.allocate(1)
    assert new_page == page and new_tag != tag
    events = [list(s) for s in streams]
    assert events[1][-1].finish_reason == "error" and isinstance(events[1][-1].error, KVIntegrityError)
    for i in (0, 2):
        assert [ev.token_id for ev in events[i] if ev.token_id is not None] == clean[i].token_ids
    sched.decode_alloc.free(new_page, new_tag)
    assert pool_is_full(e)


def test_fp8_kv_and_fp8_indexer_keys_quality_vs_bf16(tiny):
    """The quality harness (teacher-forced through the paged prefill; an FP8 pool holds FP8 latent rows and FP8
    indexer keys, exactly what decode reads) on 4 windows of 128 tokens, each query past the 8th attending to its
    8 selected tokens: top-1 agreement and KL against a BF16 pool, printed, for FP8 KV + FP8 indexer keys, FP8 KV
    + BF16 indexer keys (the option) and an f32 pool. Bounds from the measured values with margin. On this random
    tiny model FP8 indexer keys cost more than FP8 latent rows: its index scores are nearly flat, so 3-bit
    mantissas reorder the top-k (measured top-1 0.66 / 0.86 / 0.96, mean KL 2.9e-2 / 5.9e-3 / 2.5e-3)."""
    hf, cfg, model = tiny
    w = quality.make_windows(np.asarray(_prompt(4 * 129, seed=7), np.int32), 128)
    ref = quality.logprobs(model, w, "bf16", batch_size=4)
    runs = {name: quality.compare_logprobs(ref, quality.logprobs(model, w, kv, batch_size=4, index_dtype=idx), w)
            for name, kv, idx in (("fp8 KV + fp8 index keys", "fp8", None), ("fp8 KV + bf16 index keys", "fp8", "bf16"),
                                  ("f32 KV", "f32", None))}
    print(f"\nDSA tiny glm_moe_dsa vs BF16 KV, {w.size - len(w)} tokens, index_topk {TOPK}:")
    for name, r in runs.items():
        print(f"  {name:<26} top-1 {r['top1_agreement']:.4f}  mean KL {r['mean_kl']:.2e}  max KL {r['max_kl']:.2e}")
    fp8, fp8_bf16_keys, f32 = runs.values()
    assert 0 < fp8["mean_kl"] < 0.06 and fp8["top1_agreement"] >= 0.55
    assert fp8_bf16_keys["mean_kl"] < fp8["mean_kl"] and fp8_bf16_keys["top1_agreement"] >= 0.75
    assert f32["mean_kl"] < fp8_bf16_keys["mean_kl"] and f32["top1_agreement"] >= 0.9
