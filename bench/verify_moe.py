"""The routed experts of one MoE layer of the embedded model (bf16, as the CPU compute layout serves it) at the
token counts of small decode and verify programs, by each algorithm `MoE.routed` can take and by candidates, each
jitted alone, their calls interleaved A B C A B C ... (a drift in the shared host's load hits every one alike).

Usage: python bench/verify_moe.py [--tokens 1,2,4,8,16] [--algos gathered,dense_all,grouped,unrolled]
                                  [--reps 300] [--json bench/results/verify_moe.json]

Algorithms (x [N, H], top-k routing over E experts, N x k pairs):
- "routed": `MoE.routed` as the tree picks (the reference each other's output is compared with);
- "gathered": each pair's expert weights gathered (`Experts.gathered`: the tree's choice while N x k <= E);
- "dense_all": every token through every expert (`Experts.dense_all`);
- "grouped": pairs sorted by expert, the XLA grouped tiles (`Experts.__call__`);
- "mulred": as "gathered", each product a multiply and a sum over the input dim (one fusion with the gather,
  no gathered copy of the weights);
- "gathered2": as "gathered", each pair's row padded with a zero row (a 2-row bf16 product per pair);
- "unrolled": every token through every expert as E separate 2-D products per projection (no batched dot), the
  weighted sum folded into the down projection as dense_all does.
Per (tokens, algo): ms (median, min..max, p10), max |difference| from "routed" (f32), and the load (/proc/loadavg).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from jaxserve.config import from_hf_config  # noqa: E402
from jaxserve.models.layers import MoE  # noqa: E402

CONFIG = ROOT / "checkpoints" / "tiny-kimi" / "config.json"


def _pairs(moe: MoE, flat: jax.Array, w: jax.Array, ids: jax.Array):  # noqa: ANN202
    n, k = ids.shape
    return jnp.arange(n * k, dtype=jnp.int32) // k, ids.reshape(-1), w.reshape(-1)


def _per_expert(moe: MoE, flat: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    token, local, weight = _pairs(moe, flat, w, ids)
    e = moe.experts.gate.shape[0]
    return jnp.zeros((flat.shape[0], e + 1), jnp.float32).at[token, local].add(weight)[:, :e]


def gathered(moe: MoE, flat: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    return moe.routed_by_gather(flat, *_pairs(moe, flat, w, ids))


def dense_all(moe: MoE, flat: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    return moe.routed_by_dense(flat, *_pairs(moe, flat, w, ids))


def grouped(moe: MoE, flat: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    token, local, _ = _pairs(moe, flat, w, ids)
    return moe.routed_by_groups(flat, w, token, local)


def unrolled(moe: MoE, flat: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    ex = moe.experts
    e, _, inter = ex.gate.shape
    per = _per_expert(moe, flat, w, ids)
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)  # noqa: E731
    hs = []
    for i in range(e):
        h = jax.nn.silu(dot(flat, ex.gate[i]).astype(flat.dtype)) * dot(flat, ex.up[i]).astype(flat.dtype)
        wi = per[:, i:i + 1]
        hs.append(jnp.where(wi != 0, h.astype(jnp.float32) * wi, 0).astype(flat.dtype))
    return dot(jnp.concatenate(hs, axis=1), ex.down[...].reshape(e * inter, -1))


def mulred(moe: MoE, flat: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    token, local, weight = _pairs(moe, flat, w, ids)
    ex = moe.experts

    def mm(x: jax.Array, wt: jax.Array) -> jax.Array:  # a multiply-and-reduce over the gathered rows: no dot
        return jnp.sum(x.astype(jnp.float32)[:, :, None] * wt[...][local].astype(jnp.float32), axis=1).astype(x.dtype)

    xs = flat[token]
    y = mm(jax.nn.silu(mm(xs, ex.gate)) * mm(xs, ex.up), ex.down)
    return jnp.zeros((flat.shape[0], flat.shape[-1]), jnp.float32).at[token].add(y.astype(jnp.float32) * weight[:, None])


def gathered2(moe: MoE, flat: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    token, local, weight = _pairs(moe, flat, w, ids)
    ex = moe.experts

    def mm(x: jax.Array, wt: jax.Array) -> jax.Array:  # each pair's row and a zero row: a 2-row bf16 product
        x2 = jnp.stack([x, jnp.zeros_like(x)], axis=1)  # [M, 2, K]
        return jnp.einsum("mrk,mkn->mrn", x2, wt[...][local], preferred_element_type=jnp.float32)[:, 0].astype(x.dtype)

    xs = flat[token]
    y = mm(jax.nn.silu(mm(xs, ex.gate)) * mm(xs, ex.up), ex.down)
    return jnp.zeros((flat.shape[0], flat.shape[-1]), jnp.float32).at[token].add(y.astype(jnp.float32) * weight[:, None])


ALGOS = {"routed": lambda m, f, w, i: m.routed(f, w, i, 0), "gathered": gathered, "dense_all": dense_all,
         "grouped": grouped, "unrolled": unrolled, "mulred": mulred,
         "gathered2": gathered2}


def measure(moe: MoE, n: int, algos: list[str], reps: int) -> list[dict]:
    graph, state = nnx.split(moe)
    x = jax.random.normal(jax.random.key(n), (n, moe.cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    fns = {}
    for a in ["routed", *algos]:
        def f(st, x, a=a):  # noqa: ANN001, ANN202
            m = nnx.merge(graph, st)
            w, ids = m.route(x)
            return ALGOS[a](m, x, w, ids)
        fns[a] = jax.jit(f)
    ref = np.asarray(jax.block_until_ready(fns["routed"](state, x)), np.float32)
    diff = {a: float(np.abs(np.asarray(fn(state, x), np.float32) - ref).max()) for a, fn in fns.items()}
    ms: dict[str, list[float]] = {a: [] for a in fns}
    load0 = os.getloadavg()
    for i in range(reps + 5):
        for a, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(state, x))
            if i >= 5:
                ms[a].append((time.perf_counter() - t0) * 1e3)
    load1 = os.getloadavg()
    return [{"tokens": n, "algo": a, "ms": {**common.spread(v), "p10": float(np.percentile(v, 10))},
             "max_abs_diff_vs_routed": diff[a], "loadavg_start": load0, "loadavg_end": load1} for a, v in ms.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--algos", default="gathered,dense_all,grouped,unrolled")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "verify_moe.json")
    args = ap.parse_args()
    cfg = from_hf_config(json.loads(CONFIG.read_text()))
    moe = MoE(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), path="layers.1.mlp")
    out = {"bench": "verify_moe", "machine": common.machine(), "rows": []}
    lines = []
    for n in (int(t) for t in args.tokens.split(",")):
        for row in measure(moe, n, args.algos.split(","), args.reps):
            out["rows"].append(row)
            ms = row["ms"]
            lines.append(f"tokens {n:>2} {row['algo']:<10} {ms['median']:.3f} ms ({ms['min']:.3f}..{ms['max']:.3f}, "
                         f"p10 {ms['p10']:.3f}), max diff {row['max_abs_diff_vs_routed']:.2e}, "
                         f"load {row['loadavg_start'][0]:.1f}->{row['loadavg_end'][0]:.1f}")
            print(lines[-1], flush=True)
    return common.write_result(out, "\n".join(lines), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
