"""Which XLA:CPU ops make a row's result depend on its batch (issue 32 item 6), and whether the deterministic
programs' fixed-shape tiles (`jaxserve.engine.invariant`) remove it.

Usage: python bench/batch_invariance.py ops        (op by op: seconds)
       python bench/batch_invariance.py e2e bf16|f32 (the embedded model's decode logits: minutes)

ops: one row computed alone (or at the smallest shape) vs among more rows / over a longer padded axis, bitwise:
matmuls by row count M (XLA:CPU picks kernels by shape), a row-wise mean of squares (RMSNorm's) by rows, the MoE
(its algorithm follows the token count) by tokens, log-softmax over the vocabulary by rows, and the paged decode
attention by rows and block-table width. e2e: the embedded checkpoint's decode logits of one row (a real 21-token
context) in row buckets 1..32 at rows 0 and B - 1, block tables of 8..32 pages, by the default decode body and by
`invariant.tiled_decode_step` (16-row tiles); '=' is bitwise equal to the row alone at 8 pages.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
EMBEDDED = ROOT / "checkpoints" / "tiny-kimi"


def _same(a: jax.Array, b: jax.Array) -> str:
    return "=" if (np.asarray(a, np.float32) == np.asarray(b, np.float32)).all() else "X"


def ops() -> None:
    from jaxserve.cache import KVLayout
    from jaxserve.config import from_hf_config
    from jaxserve.models.layers import MoE
    from jaxserve.models.paged_attention_xla import mla_decode

    key = jax.random.key(0)
    mm = jax.jit(lambda x, w: jnp.matmul(x, w, preferred_element_type=jnp.float32))
    for dt in (jnp.float32, jnp.bfloat16):
        for k, n in ((256, 768), (768, 256), (256, 4096)):
            x = jax.random.normal(key, (64, k), jnp.float32).astype(dt)
            w = (jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * 0.05).astype(dt)
            one, r16 = np.asarray(mm(x[:1], w))[0], np.asarray(mm(x[:16], w))
            print(f"matmul {dt.__name__} {k}x{n} row 0 vs alone (M=1):",
                  " ".join(f"M{m}:{_same(mm(x[:m], w)[0], one)}" for m in (2, 4, 8, 16, 32, 64)),
                  f"| vs M=16: M8:{_same(mm(x[:8], w), r16[:8])} M32:{_same(mm(x[:32], w)[:16], r16)}"
                  f" | at row 5 of 16: {_same(mm(jnp.roll(x[:16], 5, 0), w)[5], r16[0])}")
    x = jax.random.normal(key, (64, 256), jnp.float32)
    f = jax.jit(lambda v: jnp.mean(v * v, axis=-1))
    print("mean of squares [B, 256] f32 row 0 vs B=1:", " ".join(f"B{b}:{_same(f(x[:b])[0], f(x[:1])[0])}"
                                                               for b in (2, 4, 8, 16, 32, 64)))
    ls = jax.jit(lambda v: jax.nn.log_softmax(v, axis=-1))
    v = jax.random.normal(key, (32, 4096), jnp.float32) * 4
    print("log_softmax [B, 4096] f32 row 0 vs B=1:", " ".join(f"B{b}:{_same(ls(v[:b])[0], ls(v[:1])[0])}"
                                                            for b in (2, 4, 8, 16, 32)))
    cfg = from_hf_config(json.loads((EMBEDDED / "config.json").read_text()))
    for dt in (jnp.float32, jnp.bfloat16):
        moe = MoE(cfg, dtype=dt, rngs=nnx.Rngs(0), path="layers.1.mlp")
        xs = jax.random.normal(key, (64, 1, cfg.hidden_size), jnp.float32).astype(dt)
        run = jax.jit(lambda a: moe(a))
        print(f"MoE {dt.__name__} token 0 vs alone:", " ".join(f"N{b}:{_same(run(xs[:b])[0], run(xs[:1])[0])}"
                                                               for b in (2, 4, 8, 16, 32, 64)))
    lay = KVLayout(kind="mla", num_layers=1, kv_lora_rank=64, qk_rope_head_dim=16, page_size=4, dtype="bf16")
    pool = jax.lax.bitcast_convert_type(jax.random.normal(key, (1, 300, 4, 80), jnp.bfloat16), jnp.uint16)
    q = jax.random.normal(jax.random.key(2), (32, 4, 80), jnp.float32)

    def att(b: int, m: int) -> jax.Array:
        bt = np.zeros((b, m), np.int32)
        bt[:, :8] = 1 + np.arange(b * 8).reshape(b, 8) % 299
        return mla_decode(q[:b], pool, None, jnp.asarray(bt), jnp.full((b,), 30, jnp.int32), layer=0, layout=lay,
                          kv_lora_rank=64, softmax_scale=0.1)[0]

    print("paged MLA decode attention row 0 vs (B=1, M=8):", " ".join(
        f"B{b}/M{m}:{_same(att(b, m), att(1, 8))}" for m in (8, 16, 32, 64) for b in (1, 4, 16, 32)))


def e2e(dtype: str) -> None:
    from engine_util import small_config
    from jaxserve.engine import Engine, invariant
    from jaxserve.engine.batch import sampling_arrays
    from jaxserve.models.paged import DecodeBatch, PrefillBatch, decode, prefill

    rows, per_row, ps = 32, 8, 4
    fmts = (dict(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4") if dtype == "bf16" else
            dict(kv_dtype="f32", prefill_weights="f32", decode_weights="f32"))
    e = Engine.from_checkpoint(EMBEDDED, small_config(dtype=dtype, max_model_len=128, max_batch=32,
                                                      num_decode_pages=rows * per_row + 8, **fmts), start=False)
    ph = e.programs.decode_phase
    rng = np.random.default_rng(0)
    lens = rng.integers(5, per_row * ps - 2, rows).astype(np.int32)
    lens[0] = 21
    t = per_row * ps
    tok = rng.integers(0, 4000, (rows, t)).astype(np.int32)
    tables = (1 + np.arange(rows)[:, None] * per_row + np.arange(per_row)[None]).astype(np.int32)
    pos = np.tile(np.arange(t, dtype=np.int32), (rows, 1))
    slots = np.where(pos < lens[:, None], tables[np.arange(rows)[:, None], pos // ps] * ps + pos % ps, -1)
    pb = PrefillBatch(*map(jnp.asarray, (tok, pos, slots.astype(np.int32), tables, lens, lens)))
    pages = jax.jit(lambda st, pg, b: prefill(nnx.merge(ph.graphdef, st), pg, b, integrity=False)[1])(
        ph.state, ph.pages, pb)

    def step(graphdef, state, pages, batch, samp, *, integrity, attention):  # noqa: ANN001, ANN202
        logits, pages, ok = decode(nnx.merge(graphdef, state), pages, batch, integrity=integrity, attention=attention)
        return logits, ok, pages

    from jaxserve.models.attention_backend import AttentionBackend
    att = AttentionBackend()
    plain = jax.jit(lambda st, pg, b, s: step(ph.graphdef, st, pg, b, s, integrity=False, attention=att)[0])
    tiled = jax.jit(lambda st, pg, b, s: invariant.tiled_decode_step(step, ph.graphdef, st, pg, b, s, tile=16,
                                                                     integrity=False, attention=att)[0])

    def row0(fn, b: int, m: int, at: int) -> np.ndarray:  # noqa: ANN001
        idx = [i % (rows - 1) + 1 for i in range(b)]
        idx[at] = 0
        bt = np.zeros((b, m), np.int32)
        bt[:, :per_row] = tables[idx]
        p = lens[idx]
        batch = DecodeBatch(*map(jnp.asarray, (tok[idx, 0], p, (tables[idx, p // ps] * ps + p % ps).astype(np.int32),
                                               bt, p + 1, np.zeros((b, m), np.uint32), np.full(b, per_row, np.int32))))
        return np.asarray(fn(ph.state, pages, batch, sampling_arrays([None] * b)))[at]

    for name, fn in (("default", plain), ("tiled16", tiled)):
        ref = row0(fn, 1, 8, 0)
        cells = [f"B{b}/M{m}/@{at}:{_same(row0(fn, b, m, at), ref)}" for m in (8, 12, 16, 32)
                 for b in (1, 2, 4, 8, 16, 32) for at in sorted({0, b - 1})]
        print(f"decode logits {dtype} {name}:", " ".join(cells), flush=True)


if __name__ == "__main__":
    ops() if sys.argv[1] == "ops" else e2e(sys.argv[2])
