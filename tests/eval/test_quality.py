"""eval-quality: the teacher-forced comparison itself (any model), and the serving formats' quality on the embedded
model: INT4 decode weights and FP8 KV stay close to BF16 (bounds set from measured values, with margin)."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_tiny
from jaxserve.convert.converter import convert
from jaxserve.checkpoint import load
from jaxserve.eval import quality
from jaxserve.models import forward
from jaxserve.quant.apply import quantize_model
from jaxserve.quant.weight_format import WeightFormat
from jaxserve.tokenizer import Tokenizer

CKPT = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-kimi"
needs_embedded = pytest.mark.skipif(not (CKPT / "jaxserve.json").exists(),
                                    reason="checkpoints/tiny-kimi not present (trained and committed separately)")


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    hf_tiny.save(hf_tiny.build("deepseek_v3"), root / "hf")
    return load(convert(root / "hf", root / "ck", progress=False))[1]


def test_compare_is_exact_on_identical_and_matches_forward(random_model):
    w = quality.make_windows(np.random.default_rng(0).integers(0, 256, 4 * 33).astype(np.int32), 32)
    assert w.shape == (4, 33)
    same = quality.compare(random_model, random_model, w, batch_size=4)
    assert same["mean_kl"] == 0.0 and same["top1_agreement"] == 1.0 and same["ppl_a"] == same["ppl_b"]
    assert same["n_tokens"] == 4 * 32
    # the paged prefill over a BF16 pool gives the absorbed forward's distribution up to bf16 rounding: the
    # cache's and, this model computing in bf16, the attention dots' (bf16 operands, as the flash kernels). The bound
    # is the model's own bf16 noise: its plain and absorbed forwards (the same math) differ by as much. Measured:
    # |d log p| mean 0.041 vs 0.067, max 1.62 vs 1.75 nats (one near-tie token, e.g. in routing); a wrong page or
    # mask moves every token by nats
    lp = quality.logprobs(random_model, w, "bf16", batch_size=4)
    x = jnp.asarray(w[:, :-1])
    ref, plain = (np.asarray(jax.nn.log_softmax(forward(random_model, x, absorbed=a).astype(jnp.float32), -1))
                  for a in (True, False))
    err, noise = np.abs(lp - ref).max(-1), np.abs(plain - ref).max(-1)
    assert err.mean() <= 1.5 * noise.mean() and err.max() <= 1.5 * noise.max(), (err.mean(), noise.mean())
    other = quality.compare(random_model, quantize_model(random_model, WeightFormat("int4")), w, batch_size=4)
    assert other["mean_kl"] > 0 and other["max_kl"] >= other["mean_kl"]


def test_greedy_agreement():
    g = quality.greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert g == {"identical_fraction": 7 / 8, "prefix_fraction": (2 / 4 + 1) / 2, "n_tokens": 8}


# Measured on checkpoints/tiny-kimi (2048 held-out tokens, 8 windows x 256, as below; deterministic on CPU), the
# 2,300-step model (held-out 1.56 bits/byte; the 583-step one it replaced gave INT4 0.9546 / FP8 KV 0.9731):
# INT4 g32 routed experts vs BF16: top-1 0.9644, mean KL 0.0026, ppl 34.86 -> 34.81;
# FP8 KV vs BF16 KV:               top-1 0.9580, mean KL 0.0054, ppl 34.86 -> 34.93.
# KL bounds are ~2x the measurement; INT4 top-1 stays at the goal (0.95), FP8 KV top-1 about 1% under its measure.
INT4_TOP1_MIN, INT4_KL_MAX = 0.95, 0.006
FP8KV_TOP1_MIN, FP8KV_KL_MAX = 0.95, 0.011


@needs_embedded
def test_embedded_int4_weights_and_fp8_kv_close_to_bf16():
    _, base = load(CKPT)
    w = quality.make_windows(quality.heldout_tokens(Tokenizer(CKPT), 8 * 257), 256)
    lp_ref = quality.logprobs(base, w, "bf16")
    int4 = quality.compare_logprobs(lp_ref, quality.logprobs(quantize_model(base, WeightFormat("int4", 32)), w,
                                                             "bf16"), w)
    fp8kv = quality.compare_logprobs(lp_ref, quality.logprobs(base, w, "fp8"), w)
    print("int4", int4, "fp8kv", fp8kv)
    assert int4["top1_agreement"] >= INT4_TOP1_MIN and int4["mean_kl"] <= INT4_KL_MAX, int4
    assert fp8kv["top1_agreement"] >= FP8KV_TOP1_MIN and fp8kv["mean_kl"] <= FP8KV_KL_MAX, fp8kv
    assert abs(int4["ppl_b"] / int4["ppl_a"] - 1) < 0.05
