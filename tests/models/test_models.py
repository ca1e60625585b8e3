"""jaxserve's three model families against transformers' PyTorch models (float32, eager), via the real converter."""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_tiny
import jaxserve
from jaxserve.convert.converter import convert
from jaxserve.models import forward

ARCHS = ["deepseek_v3", "glm_moe_dsa", "glm4_moe"]


def _converted(tmp: Path, arch: str, **config_args: int):
    hf = hf_tiny.build(arch, **config_args)
    hf_tiny.save(hf, tmp / "hf")
    convert(tmp / "hf", tmp / "jx", dtype="float32", progress=False)
    cfg, model = jaxserve.load(tmp / "jx")
    return hf, cfg, model


@pytest.fixture(scope="module", params=ARCHS)
def converted(request, tmp_path_factory):
    return (request.param, *_converted(tmp_path_factory.mktemp(request.param), request.param))


def _max_rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_logits_match_transformers(converted):
    arch, hf, cfg, model = converted
    assert cfg.model_type == arch
    tokens = torch.randint(0, cfg.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    ref = hf_tiny.logits(hf, tokens).numpy()
    got = np.asarray(forward(model, jnp.asarray(tokens.numpy(), jnp.int32)))
    assert got.shape == ref.shape
    assert _max_rel_err(got, ref) <= 1e-4


def test_absorbed_mla_equals_plain(converted):
    arch, hf, cfg, model = converted
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 11)), jnp.int32)
    plain = np.asarray(forward(model, tokens))
    absorbed = np.asarray(forward(model, tokens, absorbed=True))
    # GQA has no absorbed form: the flag is a no-op there, and the check still holds exactly.
    assert _max_rel_err(absorbed, plain) <= 1e-5


def test_right_padding_equals_unpadded_rows(converted):
    arch, hf, cfg, model = converted
    rng = np.random.default_rng(3)
    lengths = [5, 9, 7]
    rows = [rng.integers(0, cfg.vocab_size, n) for n in lengths]
    batch = np.zeros((3, 9), np.int32)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = r
    padded = np.asarray(forward(model, jnp.asarray(batch), lengths=jnp.asarray(lengths, jnp.int32)))
    for i, r in enumerate(rows):
        alone = np.asarray(forward(model, jnp.asarray(r[None], jnp.int32)))[0]
        np.testing.assert_allclose(padded[i, : len(r)], alone, atol=1e-5 * np.abs(alone).max())


def test_group_limited_routing_matches_transformers(tmp_path):
    hf, cfg, model = _converted(tmp_path, "deepseek_v3", n_group=4, topk_group=2)
    assert (cfg.n_group, cfg.topk_group) == (4, 2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    ref = hf_tiny.logits(hf, tokens).numpy()
    assert _max_rel_err(np.asarray(forward(model, jnp.asarray(tokens.numpy(), jnp.int32))), ref) <= 1e-4


def test_dsa_indexer_is_dense_attention_within_topk(tmp_path):
    """GLM-5: for contexts <= index_topk the indexer selects every key, so DSA equals dense attention."""
    hf, cfg, model = _converted(tmp_path, "glm_moe_dsa")
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, cfg.index_topk)), jnp.int32)
    with_dsa = np.asarray(forward(model, tokens))
    for layer in model.layers:
        layer.attn.indexer = None  # no indexer and no selection: dense causal attention
    dense = np.asarray(forward(model, tokens))
    np.testing.assert_array_equal(with_dsa, dense)


def test_dsa_indexer_changes_long_context(tmp_path):
    """Beyond index_topk the selection must matter (guards against an indexer that selects everything)."""
    hf, cfg, model = _converted(tmp_path, "glm_moe_dsa")
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, cfg.vocab_size, (1, 16)), jnp.int32)
    with_dsa = np.asarray(forward(model, tokens))
    for layer in model.layers:
        layer.attn.indexer = None
    dense = np.asarray(forward(model, tokens))
    assert np.abs(with_dsa[0, cfg.index_topk:] - dense[0, cfg.index_topk:]).max() > 1e-3
    np.testing.assert_allclose(with_dsa[0, : cfg.index_topk], dense[0, : cfg.index_topk], atol=1e-5)


def test_swiglu_rounds_as_torchs_bf16_silu():
    """layers.swiglu on bf16: bitwise torch's silu(gate) * up on bf16 tensors (the silu computed in f32 and rounded
    once, then the product rounded once), over every finite bf16 gate value but those whose silu is below 1e-30
    (f32's subnormals are flushed to 0 by XLA:CPU), subnormal products flushed as well; jax.nn.silu on bf16, rounding after each of its ops, differs
    (negative control)."""
    import jax

    from jaxserve.models.layers import swiglu

    bits = np.arange(1 << 16, dtype=np.uint16)
    gate = bits.view(jnp.bfloat16)
    tiny = np.finfo(np.float32).tiny
    gate = gate[np.isfinite(gate.astype(np.float32))]
    g64 = gate.astype(np.float64)
    with np.errstate(over="ignore"):
        silu = g64 / (1 + np.exp(-g64))
    gate = gate[(g64 == 0) | (np.abs(silu) >= 1e-30)]  # far from f32's subnormals, which XLA:CPU flushes to 0
    up = np.random.default_rng(0).standard_normal(gate.shape).astype(jnp.bfloat16)
    ours = np.asarray(swiglu(jnp.asarray(gate), jnp.asarray(up))).astype(np.float32)

    def as_torch(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)

    theirs = (torch.nn.functional.silu(as_torch(gate)) * as_torch(up)).to(torch.float32).numpy()
    theirs = np.where(np.abs(theirs) < tiny, 0, theirs)  # XLA:CPU flushes subnormals
    np.testing.assert_array_equal(ours, theirs)
    chained = np.asarray(jax.nn.silu(jnp.asarray(gate)) * jnp.asarray(up)).astype(np.float32)
    assert np.sum(chained != theirs) > 0
