"""GLM-5.x DeepSeek Sparse Attention over paged KV: the indexer key cache in the page pools, top-k selection over
pages, sparse attention over the selected latent rows, IndexShare, against transformers' glm_moe_dsa (float32,
eager, full sequence, no cache) on a tiny random model with index_topk 8 and prompts of 64-200 tokens.

The tiny model's indexer has 16 heads: a key whose ReLU scores are 0 on every head scores exactly 0, and with 4
heads (1 key in 16) such exact ties often straddle the top-k boundary, where transformers' torch.topk and
lax.top_k may keep different (equally valid) keys; with 16 heads they are about 1 in 65,000.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import hf_tiny
import jaxserve
from jaxserve.cache import (KVLayout, gather_index_keys, init_pages, insert_pages, pages_to_fp8, quantize_fp8,
                            write_index_keys)
from jaxserve.config import from_hf_config
from jaxserve.convert.converter import convert
from jaxserve.engine import Engine, EngineConfig, SamplingParams
from jaxserve.engine.programs import kv_layout
from jaxserve.eval import quality
from jaxserve.models import dsa
from jaxserve.models.attention import index_scores
from jaxserve.models.paged import DecodeBatch, PrefillBatch, decode, prefill

TOPK = 8
TYPES = ("full", "shared", "full", "shared")  # IndexShare: layers 1 and 3 reuse layers 0 and 2's selection
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
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens])).logits[0].numpy()


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
    layer that is not counted."""
    from jaxserve.plan import PRESETS

    raw = dict(PRESETS["glm-5.2"])
    cfg = from_hf_config(raw)
    assert cfg.rope.theta == 8e6 and cfg.rope.rope_type == "default" and cfg.rope_dim == 64
    assert cfg.max_position_embeddings == 1048576 and cfg.num_layers == 78
    assert cfg.index_layers == (0, 1, 2, *range(6, 78, 4)) and len(cfg.index_layers) == 21
    # the explicit indexer_types list (78 entries) gives the same schedule as freq/offset
    assert from_hf_config({**raw, "indexer_types": list(cfg.indexer_types)}).index_layers == cfg.index_layers
    with pytest.raises(jaxserve.errors.ConfigError, match="indexer_types"):
        from_hf_config({**raw, "indexer_types": ["full"] * 10})


def test_bytes_per_token_include_the_indexer_keys():
    cfg = from_hf_config(__import__("jaxserve.plan", fromlist=["PRESETS"]).PRESETS["glm-5.2"])
    fp8, bf16 = kv_layout(cfg, 64, "fp8"), kv_layout(cfg, 64, "bf16")
    assert fp8.bytes_per_token() == 78 * (576 + 4) + 21 * (128 + 4)
    assert bf16.bytes_per_token() == 78 * 576 * 2 + 21 * 128 * 2
    assert kv_layout(cfg, 64, "fp8", "bf16").bytes_per_token() == 78 * (576 + 4) + 21 * 128 * 2
    for lay in (fp8, bf16):  # the real pool's arrays hold exactly that
        shapes = jax.eval_shape(lambda: init_pages(lay.__class__(**{**lay.__dict__, "num_layers": 78}), 2))
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


# ---- the model over pages against transformers -------------------------------------------------------------------
@nnx.jit(static_argnames=("all_logits",))
def _prefill(model, pages, batch, all_logits):
    return prefill(model, pages, batch, all_logits=all_logits)


@nnx.jit
def _decode(model, pages, tags, batch):
    return decode(model, pages, tags, batch, integrity=False, attention="xla")


@pytest.mark.parametrize("n_prompt,n_pages", [(150, 32), (6, 1)], ids=["sparse", "dense-within-topk"])
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
    got, chunk = [], 32
    for c0 in range(0, n_prompt, chunk):
        c1 = min(n_prompt, c0 + chunk)
        pos = np.arange(c0, c0 + chunk, dtype=np.int32)
        toks = np.zeros(chunk, np.int32)
        toks[: c1 - c0] = prompt[c0:c1]
        slots = np.asarray([slot(p) if p < c1 else -1 for p in pos], np.int32)
        batch = PrefillBatch(jnp.asarray(toks[None]), jnp.asarray(pos[None]), jnp.asarray(slots[None]), bt,
                             jnp.asarray([c1], jnp.int32), jnp.asarray([c1 - c0], jnp.int32))
        logits, pages = _prefill(model, pages, batch, True)
        got.extend(np.asarray(logits)[0, : c1 - c0])
    tags = jnp.zeros((pages.num_pages,), jnp.uint32)
    for p in range(n_prompt, len(text)):
        batch = DecodeBatch(jnp.asarray([text[p]], jnp.int32), jnp.asarray([p], jnp.int32),
                            jnp.asarray([slot(p)], jnp.int32), bt, jnp.asarray([p + 1], jnp.int32),
                            jnp.zeros((1, n_pages), jnp.uint32), jnp.asarray([n_pages], jnp.int32))
        logits, pages, ok = _decode(model, pages, tags, batch)
        got.append(np.asarray(logits)[0])
    got = np.stack(got)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
