"""FP8 KV layouts for MLA, measured on the embedded model: per-token single scale (jaxserve's FP8 pool) vs
FlashMLA's layout (FP8 latent with one f32 scale per 128 columns + the rope part in BF16: 656 B/token/layer at
Kimi's 512 + 64), each against BF16 KV; top-1 agreement and KL of the next-token distributions, and bytes/token.

Usage: python bench/kv_layout_quality.py [--windows 16] [--json bench/results/kv_layout_quality.json]

Method (a reference-level measurement, no new cache layout is built): a teacher-forced forward over held-out
windows (`jaxserve.eval.quality` data) in which every layer's latent row [c_kv | k_rope] is quantized and
dequantized by the layout before attention reads it, exactly the values an FP8 page of that layout would give
back (dequantized values are held in f32). The per-token layout is also run through the real paged prefill over
an FP8 pool (`quality.logprobs(..., "fp8")`) as a check that the emulation reproduces the engine's numbers.
The embedded model has kv_lora_rank 64 + rope 16: one 128-column tile covers its whole latent, so FlashMLA's
layout is also run with 4 tiles of 16 columns (FlashMLA's tile count at 512 columns), and a split-scale FP8
variant (c_kv and k_rope each with their own scale) tells whether the scale or the rope's FP8 rounding costs.
Which layout the pools use, and why, is in pallas_kernels/paged_attention.py's header.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from jaxserve.cache import quantize_fp8  # noqa: E402
from jaxserve.checkpoint import load  # noqa: E402
from jaxserve.eval import quality  # noqa: E402
from jaxserve.models import CausalLM  # noqa: E402
from jaxserve.tokenizer import Tokenizer  # noqa: E402

CKPT = ROOT / "checkpoints" / "tiny-kimi"
SCALE_BYTES = 4  # f32


def kv_bf16(latent: jax.Array, rank: int) -> jax.Array:
    return latent.astype(jnp.bfloat16).astype(jnp.float32)


def kv_per_token(latent: jax.Array, rank: int) -> jax.Array:
    """jaxserve's FP8 pool: the whole row [c_kv | k_rope] in e4m3 with one f32 scale."""
    q, s = quantize_fp8(latent)
    return q.astype(jnp.float32) * s[..., None]


def kv_split_scale(latent: jax.Array, rank: int) -> jax.Array:
    """A variant between the two: c_kv and k_rope both e4m3, each with its own f32 scale (4 more bytes than
    per-token): tells whether the rope part sharing c_kv's scale or its FP8 rounding costs the quality."""
    parts = [quantize_fp8(x) for x in (latent[..., :rank], latent[..., rank:])]
    return jnp.concatenate([q.astype(jnp.float32) * s[..., None] for q, s in parts], axis=-1)


def kv_tiled(latent: jax.Array, rank: int, tile: int) -> jax.Array:
    """FlashMLA's layout: c_kv in e4m3 with one f32 scale per `tile` columns, k_rope in BF16."""
    c = latent[..., :rank].astype(jnp.float32)
    tiles = c.reshape(*c.shape[:-1], rank // tile, tile)
    q, s = quantize_fp8(tiles)
    c8 = (q.astype(jnp.float32) * s[..., None]).reshape(c.shape)
    return jnp.concatenate([c8, latent[..., rank:].astype(jnp.bfloat16).astype(jnp.float32)], axis=-1)


def bytes_per_token(layout: str, rank: int, rope: int, tile: int = 128) -> int:
    """Bytes per token and layer of one MLA latent row in each layout."""
    if layout == "bf16":
        return 2 * (rank + rope)
    if layout == "fp8_per_token":
        return rank + rope + SCALE_BYTES
    if layout == "fp8_split_scale":
        return rank + rope + 2 * SCALE_BYTES
    return rank + SCALE_BYTES * (-(-rank // tile)) + 2 * rope  # fp8 c_kv + tile scales + bf16 rope


@functools.partial(nnx.jit, static_argnames=("kv",))
def logprobs_with_kv(model: CausalLM, tokens: jax.Array, kv) -> jax.Array:
    """Teacher-forced next-token log-probs [B, T, V] f32; each layer's latent goes through kv(latent, rank)."""
    cfg = model.cfg
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    cos, sin = model.rope(pos)
    h = model.embed_tokens(tokens)
    for layer in model.layers:
        x = layer.input_norm(h)
        attn = layer.attn
        q_nope, q_rope, latent, _ = attn.project(x, cos, sin)
        stored = kv(latent.astype(jnp.float32), cfg.kv_lora_rank).astype(x.dtype)
        h = h + attn.o(attn.attend_plain(q_nope, q_rope, stored, mask).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_norm(h))
    return jax.nn.log_softmax(model.logits(h).astype(jnp.float32), axis=-1)


def run(model: CausalLM, windows: np.ndarray, kv, batch: int = 8) -> np.ndarray:
    x = windows[:, :-1]
    return np.concatenate([np.asarray(logprobs_with_kv(model, jnp.asarray(x[i:i + batch]), kv))
                           for i in range(0, len(x), batch)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "kv_layout_quality.json")
    args = ap.parse_args()
    _, model = load(CKPT)
    cfg = model.cfg
    r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    windows = quality.make_windows(quality.heldout_tokens(Tokenizer(CKPT), args.windows * 257), 256)
    layouts = {
        "fp8_per_token": (kv_per_token, bytes_per_token("fp8_per_token", r, dr)),
        "fp8_split_scale": (kv_split_scale, bytes_per_token("fp8_split_scale", r, dr)),
        "flashmla_tile128": (functools.partial(kv_tiled, tile=min(128, r)),
                             bytes_per_token("flashmla", r, dr, min(128, r))),
        f"flashmla_{r // 4}x4": (functools.partial(kv_tiled, tile=r // 4), bytes_per_token("flashmla", r, dr, r // 4)),
    }
    ref = run(model, windows, kv_bf16)
    out = {"checkpoint": str(CKPT), "backend": jax.default_backend(), "windows": len(windows), "window": 256,
           "kv_lora_rank": r, "rope": dr, "reference": "bf16 KV, bf16 weights (as loaded)", "layouts": {}}
    bf16_bytes = bytes_per_token("bf16", r, dr)
    for name, (fn, nbytes) in layouts.items():
        cmp = quality.compare_logprobs(ref, run(model, windows, fn), windows)
        out["layouts"][name] = {**cmp, "bytes_per_token_layer": nbytes, "tokens_vs_bf16": bf16_bytes / nbytes}
    # the emulation against the engine: the paged prefill over real BF16 and FP8 pools
    paged = quality.compare_logprobs(quality.logprobs(model, windows, "bf16"), quality.logprobs(model, windows, "fp8"),
                                     windows)
    out["engine_fp8_pool_vs_bf16_pool"] = paged
    kimi = {k: bytes_per_token(k, 512, 64) for k in ("bf16", "fp8_per_token", "fp8_split_scale", "flashmla")}
    out["kimi_bytes_per_token_layer"] = {**kimi, "per_token_vs_flashmla_capacity": kimi["flashmla"]
                                         / kimi["fp8_per_token"]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'layout':20} {'top1':>8} {'mean KL':>10} {'max KL':>8} {'B/tok/layer':>12} {'x bf16':>7}")
    for name, m in out["layouts"].items():
        print(f"{name:20} {m['top1_agreement']:8.4f} {m['mean_kl']:10.5f} {m['max_kl']:8.4f} "
              f"{m['bytes_per_token_layer']:12d} {m['tokens_vs_bf16']:7.3f}")
    print(f"engine fp8 pool vs bf16 pool: top1 {paged['top1_agreement']:.4f} mean KL {paged['mean_kl']:.5f}")
    ratio = out["kimi_bytes_per_token_layer"]["per_token_vs_flashmla_capacity"]
    print(f"Kimi (512 + 64) bytes/token/layer: {kimi}; the per-token layout holds {ratio:.3f}x FlashMLA's tokens")


if __name__ == "__main__":
    main()
