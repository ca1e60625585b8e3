"""The engine's prefill attention (jaxserve.models.paged.prefill): the blockwise XLA path against the dense path it
replaced, the flash prefill kernels (GPU and TPU tilings, interpret mode) against the XLA path at their shared
precision, and the blockwise path's memory against the context length at a 16k-token prompt.

"The dense path" (`_dense_prefill` below) is the previous prefill: gather the row's whole context from the pool
(dequantized f32) and attend over it with the [B, N, T, S] masked softmax, MLA in the plain form (kv_b expands
the context). On the same pages it differs from the blockwise path only by f32 rounding (absorbed vs plain MLA,
block order). The kernels take bf16 dot operands over bf16 / fp8 pages, and so does the XLA path for a bf16 model
(`prefill_dot_dtype`): with a bf16 model the two are compared directly, and the rounding is never mistaken for an
error (through a tiny MoE model, bf16 query rounding alone moves logits by up to 0.026 against the f32 dense path:
a routing near-tie).
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine_util import tiny_model
from jaxserve.cache import KVPages, gather_tokens, init_pages, write_tokens
from jaxserve.engine.layouts import kv_layout
from jaxserve.models.attention_backend import AttentionBackend
from jaxserve.models.paged import PrefillBatch, prefill
from jaxserve.models.transformer import CausalLM

PAGE = 4
F32_TOL = 2e-5  # absolute, on logits of magnitude <= 1: f32 rounding only
# the TPU tiling rounds each fp8 row times its scale to bf16 before its dots (pallas_kernels/paged_prefill.py; the
# per-element bound is tests/test_paged_prefill.py's): measured 0.035 (GLM-4.5 tiny) / 0.0093 (Kimi tiny) on bf16
# logits of ~0.6; every other kernel case equals the XLA path exactly (measured 0.0)
TPU_FP8_TOL = 0.05


@pytest.fixture(scope="module")
def models():
    return {"deepseek_v3": tiny_model("deepseek_v3"), "glm4_moe": tiny_model("glm4_moe")}


def _dense_prefill(model: CausalLM, pages: KVPages, batch: PrefillBatch) -> tuple[jax.Array, KVPages]:
    """The dense path (module docstring) -> (logits [B, T, V] f32, pages)."""
    cfg = model.cfg
    B, T = batch.tokens.shape
    kpos = jnp.arange(batch.block_tables.shape[1] * PAGE, dtype=jnp.int32)
    mask = (kpos[None, None, :] <= batch.positions[:, :, None]) & (kpos[None, None, :] < batch.ctx_lens[:, None, None])
    cos, sin = model.rope(batch.positions)
    slots = batch.slots.reshape(-1)
    h = model.embed_tokens(batch.tokens)
    for i, layer in enumerate(model.layers):
        x = layer.input_norm(h)
        attn = layer.attn
        if cfg.is_mla:
            q_nope, q_rope, latent, _ = attn.project(x, cos, sin)
            pages = write_tokens(pages, i, latent.reshape(B * T, -1), slots)
            o = attn.attend_plain(q_nope, q_rope, gather_tokens(pages, i, batch.block_tables), mask)
        else:
            q, k, v = attn.project(x, cos, sin)
            pages = write_tokens(pages, i, (k.reshape(B * T, *k.shape[2:]), v.reshape(B * T, *v.shape[2:])), slots)
            ck, cv = gather_tokens(pages, i, batch.block_tables)
            o = attn.attend(q, ck, cv, mask)
        h = h + attn.o(o.reshape(B, T, -1))
        h = h + layer.mlp(layer.post_norm(h))
    return model.logits(h), pages


_dense_jit = nnx.jit(_dense_prefill)


@functools.partial(nnx.jit, static_argnames=("attention",))
def _paged_prefill(model: CausalLM, pages: KVPages, batch: PrefillBatch, attention: str):
    # (logits, pages); ok unused
    return prefill(model, pages, batch, all_logits=True, attention=AttentionBackend.parse(attention))[:2]


def _chunks(model: CausalLM, tokens: np.ndarray, lens: list[int], chunk: int, kv_dtype: str, run) -> np.ndarray:
    """Prefill rows `tokens` [B, L] (row b has lens[b] real tokens, 0: a padding row) in chunks of `chunk`
    through `run(pages, batch) -> (logits, pages)` -> logits [B, L, V] (garbage past each row's length)."""
    B, L = tokens.shape
    M = -(-L // PAGE)
    pages = init_pages(kv_layout(model.cfg, PAGE, kv_dtype), 1 + B * M)
    bt = (1 + np.arange(B * M, dtype=np.int32)).reshape(B, M)
    out = []
    for s in range(0, L, chunk):
        n = np.clip(np.asarray(lens) - s, 0, chunk).astype(np.int32)  # this chunk's tokens per row
        t = np.arange(chunk)[None]
        pos = np.where(t < n[:, None], s + t, 0).astype(np.int32)  # padding slots at position 0, as the scheduler
        slots = np.where(t < n[:, None], bt[np.arange(B)[:, None], pos // PAGE] * PAGE + pos % PAGE, -1)
        ctx = np.where(n > 0, s + n, 0).astype(np.int32)
        table = np.where(np.arange(M)[None] < -(-ctx[:, None] // PAGE), bt, 0)  # unused entries: the null page
        batch = PrefillBatch(*(jnp.asarray(a, jnp.int32) for a in (tokens[:, s:s + chunk], pos, slots, table, ctx, n)))
        logits, pages = run(pages, batch)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


# the fast set covers both families and both pool dtypes on the XLA path, and GQA through a kernel (MLA runs
# through both kernel tilings in tests/test_engine.py's fast set)
ARCHS = ("deepseek_v3", "glm4_moe")
FAST = {("deepseek_v3", "xla", "fp8"), ("glm4_moe", "xla", "bf16"), ("glm4_moe", "pallas_interpret", "bf16")}


def _cases(impls: tuple[str, ...]) -> list:
    return [pytest.param(a, i, d, marks=() if (a, i, d) in FAST else pytest.mark.slow, id=f"{a}-{i}-{d}")
            for a in ARCHS for i in impls for d in ("bf16", "fp8")]


def _ragged(model: CausalLM) -> tuple[np.ndarray, list[int]]:
    """Three ragged rows (22 tokens, 9 tokens, a padding row) -> (tokens [3, 24] int32, lens)."""
    return np.random.default_rng(1).integers(0, model.cfg.vocab_size, (3, 24)).astype(np.int32), [22, 9, 0]


def _max_err(got: np.ndarray, want: np.ndarray, lens: list[int]) -> float:
    for b, n in enumerate(lens):
        assert np.isfinite(got[b, :n]).all(), b
    return max(float(np.abs(got[b, :n] - want[b, :n]).max(initial=0.0)) for b, n in enumerate(lens))


@pytest.mark.parametrize("arch,impl,kv_dtype", _cases(("xla",)))
def test_xla_prefill_equals_the_dense_path(models, arch, impl, kv_dtype):
    """The ragged rows in chunks of 8 over the same pool dtype, f32 model: every real token's logits equal the
    dense path's up to f32 rounding."""
    model = models[arch]
    tokens, lens = _ragged(model)
    want = _chunks(model, tokens, lens, 8, kv_dtype, lambda p, b: _dense_jit(model, p, b))
    got = _chunks(model, tokens, lens, 8, kv_dtype, lambda p, b: _paged_prefill(model, p, b, impl))
    assert _max_err(got, want, lens) <= F32_TOL


@pytest.mark.parametrize("arch,impl,kv_dtype", _cases(("pallas_interpret", "pallas_tpu_interpret")))
def test_kernel_prefill_equals_the_xla_path_at_its_precision(arch, impl, kv_dtype):
    """The ragged rows in chunks of 8, bf16 model (the XLA path then takes bf16 dot operands, as the kernels): the
    kernels give the XLA path's logits (TPU tiling over fp8 pages: within its extra rounding, TPU_FP8_TOL)."""
    model = CausalLM(tiny_model(arch).cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    tokens, lens = _ragged(model)
    want = _chunks(model, tokens, lens, 8, kv_dtype, lambda p, b: _paged_prefill(model, p, b, "xla"))
    got = _chunks(model, tokens, lens, 8, kv_dtype, lambda p, b: _paged_prefill(model, p, b, impl))
    tol = TPU_FP8_TOL if impl.startswith("pallas_tpu") and kv_dtype == "fp8" else 1e-6
    assert _max_err(got, want, lens) <= tol


def test_prefill_is_independent_of_the_chunking(models):
    """The same prompt in chunks of 4 and in one chunk of 24 gives the same logits (context read from pages)."""
    model = models["deepseek_v3"]
    tokens = np.random.default_rng(2).integers(0, 256, (1, 24)).astype(np.int32)
    run = lambda p, b: _paged_prefill(model, p, b, "xla")  # noqa: E731
    a = _chunks(model, tokens, [24], 4, "bf16", run)
    b = _chunks(model, tokens, [24], 24, "bf16", run)
    np.testing.assert_allclose(a, b, atol=F32_TOL, rtol=0)


def _dot_operand_types(text: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general in a lowered program's StableHLO text."""
    t = r"tensor<(?:[0-9?]+x)*(\w+)>"
    sig = re.findall(rf"stablehlo\.dot_general .*?: \({t}, {t}\) -> {t}", text)
    return [tuple(x) for x in sig]


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_a_bf16_model_attends_with_bf16_dots_and_an_f32_model_with_f32(arch):
    """The XLA prefill's attention dots take bf16 operands (f32 results) for a bf16 model over bf16 pages, as the
    flash kernels, and f32 ones for an f32 model or f32 pages: the bf16 model has exactly two more bf16 dots
    (scores, values) per layer over bf16 pages than over f32 pages, the f32 model none. (Their numerics:
    tests/test_paged_prefill.py's blockwise_bf16 bound; tests/test_quality.py's noise-floor check.)"""
    cfg = tiny_model(arch).cfg

    def bf16_dots(dtype: jnp.dtype, kv_dtype: str) -> list[tuple[str, str, str]]:
        model = CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        pages = jax.eval_shape(lambda: init_pages(kv_layout(cfg, PAGE, kv_dtype), 1 + 16))
        dots = _dot_operand_types(_paged_prefill.lower(model, pages, _single_chunk(16), "xla").as_text())
        assert dots, "no dot_general found: the pattern no longer matches the lowered text"
        return [d for d in dots if "bf16" in d[:2]]

    assert bf16_dots(jnp.float32, "bf16") == []
    low, exact = bf16_dots(jnp.bfloat16, "bf16"), bf16_dots(jnp.bfloat16, "f32")
    assert len(low) - len(exact) == 2 * cfg.num_layers and set(low) == {("bf16", "bf16", "f32")}, (low, exact)


# ---------------------------------------------------------------------------------------------------------------
# Memory at a 16k-token prompt: compiled temporaries of one whole-prompt chunk at 8k and 16k tokens.


def _single_chunk(n: int) -> PrefillBatch:
    m = n // PAGE
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    return PrefillBatch(jnp.zeros((1, n), jnp.int32), pos, PAGE + pos,  # pages 1.. in order
                        (1 + jnp.arange(m, dtype=jnp.int32))[None], jnp.asarray([n], jnp.int32),
                        jnp.asarray([n], jnp.int32))


def _temp_bytes(model: CausalLM, n: int, fn) -> int:
    pages = jax.eval_shape(lambda: init_pages(kv_layout(model.cfg, PAGE, "bf16"), 1 + n // PAGE))
    compiled = nnx.jit(fn).lower(model, pages, _single_chunk(n)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("arch", ["deepseek_v3", pytest.param("glm4_moe", marks=pytest.mark.slow)])
def test_prefill_memory_grows_linearly_with_the_prompt(models, arch):
    """A prompt of 8k and of 16k tokens prefilled as one chunk: the blockwise path's temporaries grow ~2x
    (chunk x block), the dense path's ~4x (chunk x context, its [B, N, T, S] logits) (negative control).
    Measured (deepseek_v3 tiny, 4 heads): blockwise 95 -> 190 MiB, dense 4.1 -> 16.4 GiB."""
    model = models[arch]
    small, large = 8192, 16384

    def blockwise(m, p, b):
        return prefill(m, p, b, attention=AttentionBackend("xla"))[0]

    def dense(m, p, b):
        return _dense_prefill(m, p, b)[0][:, -1]

    bw = [_temp_bytes(model, n, blockwise) for n in (small, large)]
    dn = [_temp_bytes(model, n, dense) for n in (small, large)]
    heads = model.cfg.num_heads
    assert bw[1] <= 2.25 * bw[0], bw  # linear (plus constant): not quadratic
    assert dn[1] >= 3.5 * dn[0], dn  # the check can fail: the dense path is quadratic
    assert dn[1] - dn[0] >= heads * (large * large - small * small) * 4  # its [N, T, S] f32 logits
    assert bw[1] < dn[1] / 8, (bw, dn)


@pytest.mark.slow
def test_prefill_of_a_16k_prompt_runs_blockwise(models):
    """A 16k-token prompt through the blockwise path in four 4096-token chunks: finite, and its last logits equal
    those of two 8192-token chunks (the context is read back from the pool either way)."""
    model = models["deepseek_v3"]
    tokens = np.random.default_rng(3).integers(0, 256, (1, 16384)).astype(np.int32)
    # -> (last-token logits [B, V], pages)
    last = nnx.jit(functools.partial(prefill, attention=AttentionBackend("xla")))

    def run(pages: KVPages, batch: PrefillBatch) -> tuple[jax.Array, KVPages]:
        logits, pages, _ = last(model, pages, batch)
        return logits[:, None], pages

    a = _chunks(model, tokens, [16384], 4096, "bf16", run)  # [1, 4, V]: each chunk's last token
    b = _chunks(model, tokens, [16384], 8192, "bf16", run)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a[:, -1], b[:, -1], atol=1e-4, rtol=0)


def test_blockwise_reads_one_layer_of_a_bit_pattern_pool():
    """The engine's form of the blockwise call (all layers' bits, the layer picked inside each gather) equals the
    call on that layer's values, MLA fp8 and GQA bf16; a bits pool without its value dtype is refused."""
    from jaxserve.models.prefill_attention_xla import prefill_gqa_blockwise, prefill_mla_blockwise

    rng = np.random.default_rng(4)
    bt = jnp.asarray([[3, 1, 0], [2, 4, 5]], jnp.int32)
    pos = jnp.asarray([[4, 5, 6], [0, 1, 2]], jnp.int32)
    ctx = jnp.asarray([7, 9], jnp.int32)
    vals = jnp.asarray(rng.standard_normal((2, 6, PAGE, 24)), jnp.float8_e4m3fn)  # [L, P, ps, r + dr]
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (2, 6, PAGE)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 24)), jnp.float32)
    kw = dict(kv_lora_rank=16, softmax_scale=0.3, block_pages=2)
    want = prefill_mla_blockwise(q, vals[1], bt, pos, ctx, scales[1], **kw)
    bits = jax.lax.bitcast_convert_type(vals, jnp.uint8)
    got = prefill_mla_blockwise(q, bits, bt, pos, ctx, scales, value_dtype=jnp.dtype(jnp.float8_e4m3fn), layer=1,
                                **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError):
        prefill_mla_blockwise(q, bits[1], bt, pos, ctx, scales[1], **kw)
    k = jnp.asarray(rng.standard_normal((3, 6, PAGE, 2, 8)), jnp.bfloat16)  # [L, P, ps, Hkv, D]
    v = jnp.asarray(rng.standard_normal((3, 6, PAGE, 2, 8)), jnp.bfloat16)
    qg = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
    want = prefill_gqa_blockwise(qg, k[2], v[2], bt, pos, ctx, softmax_scale=0.3, block_pages=2)
    kb, vb = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k, v))
    got = prefill_gqa_blockwise(qg, kb, vb, bt, pos, ctx, softmax_scale=0.3, block_pages=2,
                                value_dtype=jnp.dtype(jnp.bfloat16), layer=2)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
