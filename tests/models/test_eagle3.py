"""EAGLE-3 drafts (`jaxserve.models.eagle3`, `paged_eagle3`): a tiny random checkpoint in the published layout loads,
and its draft logits (and chained outputs) equal an independent torch forward built from transformers' Llama parts;
the paged prefill's aux hidden states are the dense model's layer inputs; the draft's K/V round-trip through the
packed pool layers of an MLA and a GQA pool (f32 and FP8); a bad checkpoint is a typed error naming what is wrong."""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3_tiny import TorchEagle3, write_draft
from engine_util import tiny_model
from jaxserve.cache import KVLayout, init_pages
from jaxserve.errors import CheckpointError, ConfigError
from jaxserve.models.decoder import causal_mask
from jaxserve.models.eagle3 import eagle3_forward, load_eagle3, read_config
from jaxserve.models.paged import PrefillBatch, prefill
from jaxserve.models.paged_eagle3 import eagle3_extend, pool_layers, read_draft_kv, write_draft_kv


@pytest.fixture(scope="module")
def target():
    return tiny_model("deepseek_v3")


@pytest.mark.parametrize("embed", [False, True], ids=["target-embed", "own-embed"])
def test_draft_logits_match_a_torch_reference(tmp_path, target, embed):
    tensors = write_draft(tmp_path, target.cfg, embed=embed)
    draft = load_eagle3(tmp_path, target.cfg, jnp.float32)
    ref = TorchEagle3(tensors, json.loads((tmp_path / "config.json").read_text()))
    rng = np.random.default_rng(1)
    B, T, H = 2, 7, target.cfg.hidden_size
    tokens = rng.integers(0, target.cfg.vocab_size, (B, T)).astype(np.int32)
    table = tensors["embed_tokens.weight"] if embed else np.asarray(target.embed[...])
    emb = table[tokens]
    aux = rng.standard_normal((B, T, 3 * H)).astype(np.float32)
    logits, h = eagle3_forward(draft, jnp.asarray(emb), jnp.asarray(aux))
    want_logits, want_h = ref(torch.from_numpy(emb), torch.from_numpy(aux))
    err = float(np.abs(np.asarray(logits) - want_logits.numpy()).max())
    assert err < 1e-4 * max(1.0, float(want_logits.abs().max())), err
    np.testing.assert_allclose(np.asarray(h), want_h.numpy(), atol=1e-5, rtol=1e-5)
    # the draft's top-1 as target ids (through d2t), and a chained step fed its own h (no fc)
    np.testing.assert_array_equal(np.asarray(draft.top1(h)), ref.top1(want_logits).numpy())
    logits2, _ = eagle3_forward(draft, jnp.asarray(emb), h)
    want2, _ = ref(torch.from_numpy(emb), want_h)
    np.testing.assert_allclose(np.asarray(logits2), want2.numpy(), atol=1e-4, rtol=1e-4)


def chunk(tokens: jax.Array, tables: jax.Array, start: int, n: int, ps: int) -> PrefillBatch:
    """Positions start .. start + n of every row (a full prompt chunk, no padding)."""
    B = tokens.shape[0]
    pos = jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (B, n))
    slots = jnp.take_along_axis(tables, pos // ps, 1) * ps + pos % ps
    return PrefillBatch(tokens[:, start:start + n], pos, slots, tables, jnp.full((B,), start + n, jnp.int32),
                        jnp.full((B,), n, jnp.int32))


def test_prefill_returns_the_target_layers_inputs_as_aux_states(target):
    cfg = target.cfg
    rng = np.random.default_rng(0)
    B, T, ps, M = 2, 8, 4, 4
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    layout = KVLayout.mla(cfg.kv_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, page_size=ps, dtype="f32")
    pages = init_pages(layout, 1 + B * M)
    tables = jnp.asarray(1 + np.arange(B * M).reshape(B, M), jnp.int32)
    aux_layers = (0, 2, cfg.num_layers)
    *_, aux = prefill(target, pages, chunk(tokens, tables, 0, T, ps), all_logits=True, aux_layers=aux_layers)
    # dense: the residual stream at each layer's input (the embeddings at 0; the last layer's output at N)
    positions, mask = causal_mask(B, T, None, None)
    cos, sin = target.rope(positions)
    h, states = target.embed_tokens(tokens), []
    for layer in target.layers:
        states.append(h)
        h, _ = layer(h, cos, sin, mask, absorbed=False, prev_selected=None)
    states.append(h)
    want = np.concatenate([np.asarray(states[i]) for i in aux_layers], -1)
    assert aux.shape == (B, T, 3 * cfg.hidden_size)
    np.testing.assert_allclose(np.asarray(aux), want, atol=2e-5, rtol=1e-4)


def test_paged_draft_rows_over_two_chunks_equal_the_dense_draft(tmp_path, target):
    """The draft rows of a prompt prefilled in two chunks (the second attends to the first's rows through the pool)
    equal the dense draft over the whole prompt, fed the same aux states and next tokens."""
    cfg = target.cfg
    write_draft(tmp_path, cfg)
    draft = load_eagle3(tmp_path, cfg, jnp.float32)
    rng = np.random.default_rng(2)
    B, T, ps, M = 2, 8, 4, 4
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)), jnp.int32)
    base = KVLayout.mla(cfg.kv_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, page_size=ps, dtype="f32")
    pages = init_pages(dataclasses.replace(base, num_layers=base.num_layers + pool_layers(draft.cfg, base)),
                       1 + B * M)
    tables = jnp.asarray(1 + np.arange(B * M).reshape(B, M), jnp.int32)
    hs, auxs = [], []
    for start in (0, T // 2):
        batch = chunk(tokens, tables, start, T // 2, ps)
        *_, pages, _, aux = prefill(target, pages, batch, all_logits=True, aux_layers=draft.cfg.aux_layers)
        h, pages = eagle3_extend(target, draft, pages, batch, aux, tokens[:, start + 1:start + 1 + T // 2])
        hs.append(h)
        auxs.append(aux)
    _, want = eagle3_forward(draft, target.embed_tokens(tokens[:, 1:]), jnp.concatenate(auxs, 1))
    np.testing.assert_allclose(np.asarray(jnp.concatenate(hs, 1)), np.asarray(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", [KVLayout.mla(3, 16, 8, page_size=4, dtype="f32"),
                                    KVLayout.gqa(2, 2, 8, page_size=4, dtype="f32"),
                                    KVLayout.mla(3, 16, 8, page_size=4, dtype="fp8")], ids=["mla", "gqa", "mla-fp8"])
def test_draft_kv_round_trips_through_packed_pool_layers(tmp_path, target, layout):
    write_draft(tmp_path, target.cfg)
    cfg = read_config(tmp_path, target.cfg)
    n = pool_layers(cfg, layout)
    base = layout.num_layers
    pages = init_pages(dataclasses.replace(layout, num_layers=base + n), 9)
    rng = np.random.default_rng(0)
    B, M, S = 2, 4, 16
    k = rng.standard_normal((B * S, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    tables = np.arange(1, 1 + B * M, dtype=np.int32).reshape(B, M)
    slots = (tables[:, :, None] * 4 + np.arange(4)).reshape(-1)
    pages = write_draft_kv(pages, base, cfg, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots), None)
    kr, vr = read_draft_kv(pages, base, cfg, jnp.asarray(tables))
    tol = 0.1 if layout.dtype == "fp8" else 0  # e4m3: 3 mantissa bits, one scale per row
    np.testing.assert_allclose(np.asarray(kr).reshape(k.shape), k, atol=tol * np.abs(k).max())
    np.testing.assert_allclose(np.asarray(vr).reshape(v.shape), v, atol=tol * np.abs(v).max())
    stored = pages.latent if layout.kind == "mla" else pages.k
    assert not np.asarray(stored[:base]).any()  # the target's layers are untouched


def test_bad_checkpoints_are_typed_errors_naming_the_tensor(tmp_path, target):
    write_draft(tmp_path / "missing", target.cfg, drop="midlayer.self_attn.k_proj.weight")
    with pytest.raises(CheckpointError, match="midlayer.self_attn.k_proj.weight") as e:
        load_eagle3(tmp_path / "missing", target.cfg, jnp.float32)
    assert e.value.param == "midlayer.self_attn.k_proj.weight"
    write_draft(tmp_path / "shape", target.cfg)
    (tmp_path / "shape" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "shape" / "config.json").read_text()), "intermediate_size": 80}))
    with pytest.raises(CheckpointError, match="midlayer.mlp.gate_proj.weight"):
        load_eagle3(tmp_path / "shape", target.cfg, jnp.float32)
    write_draft(tmp_path / "wide", target.cfg, target_hidden_size=128)
    with pytest.raises(ConfigError, match="target_hidden_size") as e:
        load_eagle3(tmp_path / "wide", target.cfg, jnp.float32)
    assert e.value.value == 128
    write_draft(tmp_path / "aux", target.cfg, aux_ids=[0, 1, 7])
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        read_config(tmp_path / "aux", target.cfg)
    with pytest.raises(CheckpointError, match="config.json"):
        read_config(tmp_path / "nowhere", target.cfg)


def test_aux_layer_ids_default_and_pinned(tmp_path, target):
    n = target.cfg.num_layers
    write_draft(tmp_path / "default", target.cfg)
    assert read_config(tmp_path / "default", target.cfg).aux_layers == tuple(sorted((2, n // 2, n - 3)))
    write_draft(tmp_path / "pinned", target.cfg, aux_ids=[2, 0, 1])  # layer outputs: inputs of the next layers
    assert read_config(tmp_path / "pinned", target.cfg).aux_layers == (1, 2, 3)
