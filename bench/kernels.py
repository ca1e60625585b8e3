"""Kernel micro-benchmarks: every Pallas kernel at the real per-device shapes, achieved HBM GB/s (and TFLOP/s)
against the chip's peak.

Usage: python bench/kernels.py [--backend gpu|tpu] [--reps N] [--only SUBSTR] --json OUT.json
       python bench/kernels.py --smoke --json OUT.json   (toy shapes, bf16 pages, interpret mode on CPU: a
       smoke test of the script, no speed meaning)

Kernels (pallas_kernels/): paged MLA and GQA decode, flash prefill over pages (MLA absorbed, GQA), int4_matmul
(decode M and prefill M), moe_gmm (INT4 decode, FP8 prefill). Shapes: Kimi K2.6 / GLM-5.x MLA per device under
TP 8 (8 heads, latent 512 + 64), GLM-4.5 GQA per device (12 q heads, 1 kv head, head 128), Kimi's expert FFN
(48 local experts of 7168 x 2048), 16-token pages, BF16 and FP8 pages.

Bytes are the unique bytes a kernel must move (KV of each row's context, weights of the experts that have rows,
activations in and out), not what a tiling re-reads; GB/s = bytes / median time. FLOPs count the matmuls
(2 per multiply-add). Peaks: nominal figures of the device kind (`PEAKS`; None for an unknown kind). A kernel that
fails to compile or run is recorded with its error and the others still run. Time: median of --reps calls after
one warm-up call (compile excluded), each ended by block_until_ready.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from pallas_kernels.int4_matmul import int4_matmul  # noqa: E402
from pallas_kernels.moe_gmm import moe_gmm  # noqa: E402
from pallas_kernels.paged_attention import paged_gqa_decode, paged_mla_decode  # noqa: E402
from pallas_kernels.paged_attention_tpu import paged_gqa_decode_tpu, paged_mla_decode_tpu  # noqa: E402
from pallas_kernels.paged_prefill import paged_prefill_gqa, paged_prefill_mla  # noqa: E402

# device kind substring -> (HBM bytes/s, dense bf16 FLOP/s), nominal vendor figures
PEAKS: dict[str, tuple[float, float]] = {
    "h200": (4.8e12, 989e12),
    "h100": (3.35e12, 989e12),
    "a100": (2.0e12, 312e12),
    "v6 lite": (1.64e12, 918e12),  # TPU v6e
    "v6e": (1.64e12, 918e12),
    "v5 lite": (8.19e11, 197e12),  # TPU v5e
    "v5p": (2.765e12, 459e12),
    "v4": (1.2e12, 275e12),
}


@dataclass(frozen=True)
class Dims:
    """One size class: attention (MLA heads, latent; GQA heads, head dim), context, batch; matmul / MoE dims."""

    mla_heads: int
    rank: int
    rope: int
    gqa_hq: int
    gqa_hkv: int
    head_dim: int
    page: int
    batch: int
    context: int
    chunk: int
    hidden: int
    ffn: int
    experts: int
    decode_rows: int
    prefill_rows: int


REAL = Dims(mla_heads=8, rank=512, rope=64, gqa_hq=12, gqa_hkv=1, head_dim=128, page=16, batch=32, context=8192,
            chunk=2048, hidden=7168, ffn=2048, experts=48, decode_rows=256, prefill_rows=4096)
TOY = Dims(mla_heads=4, rank=32, rope=16, gqa_hq=4, gqa_hkv=2, head_dim=16, page=8, batch=2, context=64, chunk=16,
           hidden=256, ffn=128, experts=4, decode_rows=8, prefill_rows=32)


@dataclass(frozen=True)
class Case:
    """A benchmarked call: fn(*make()), with the bytes and FLOPs it must move / do. `make` builds the inputs
    (traceable: jitted on the device, or `jax.eval_shape`d to lower the call without allocating)."""

    name: str
    shape: str
    fn: Callable
    make: Callable[[], tuple]
    bytes: int
    flops: int


def _pool(key: jax.Array, shape: tuple[int, ...], fp8: bool) -> tuple[jax.Array, jax.Array | None]:
    """Random page pool [P, ps, ...] bf16, or fp8 e4m3 with f32 scales [P, ps(, heads)]."""
    x = jax.random.normal(key, shape, jnp.float32)
    if not fp8:
        return x.astype(jnp.bfloat16), None
    return x.astype(jnp.float8_e4m3fn), jnp.full(shape[:-1], 0.05, jnp.float32)


def _normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)


def _tables(d: Dims, rows: int) -> tuple[jax.Array, jax.Array]:
    """Block tables [rows, M] (distinct pages from 1; page 0 is the null page), lengths [rows] = context."""
    m = d.context // d.page
    return 1 + jnp.arange(rows * m, dtype=jnp.int32).reshape(rows, m), jnp.full((rows,), d.context, jnp.int32)


def attention_cases(d: Dims, backend: str, interpret: bool, page_dtypes: tuple[str, ...]) -> list[Case]:
    out = []
    k0, k1 = jax.random.key(0), jax.random.key(1)
    tpu = backend == "tpu"
    dl = d.rank + d.rope
    pages = 1 + d.batch * (d.context // d.page)
    pages1 = 1 + d.context // d.page
    pairs = d.chunk * d.context - d.chunk * (d.chunk - 1) // 2  # causal (query, key) pairs of a prefill chunk
    mla_kw = dict(kv_lora_rank=d.rank, softmax_scale=dl ** -0.5, interpret=interpret)
    gqa_kw = dict(softmax_scale=d.head_dim ** -0.5, interpret=interpret)
    mla_decode = paged_mla_decode_tpu if tpu else paged_mla_decode
    gqa_decode = paged_gqa_decode_tpu if tpu else paged_gqa_decode
    for dt in page_dtypes:
        fp8 = dt == "fp8"
        item, scale_b = (1, 4) if fp8 else (2, 0)  # value bytes, f32 scale bytes per row (per head)

        def mla_decode_args(fp8=fp8):
            lat, sc = _pool(k0, (pages, d.page, dl), fp8)
            return (_normal(k1, (d.batch, d.mla_heads, dl)), lat, *_tables(d, d.batch), sc)

        def gqa_decode_args(fp8=fp8):
            kp, ks = _pool(k0, (pages, d.page, d.gqa_hkv, d.head_dim), fp8)
            vp, vs = _pool(k1, (pages, d.page, d.gqa_hkv, d.head_dim), fp8)
            return (_normal(k1, (d.batch, d.gqa_hq, d.head_dim)), kp, vp, *_tables(d, d.batch), ks, vs)

        def prefill_rows() -> tuple[jax.Array, jax.Array, jax.Array]:
            bt, ctx = _tables(d, 1)
            return bt, (d.context - d.chunk + jnp.arange(d.chunk, dtype=jnp.int32))[None], ctx  # chunk at the end

        def mla_prefill_args(fp8=fp8):
            lat, sc = _pool(k0, (pages1, d.page, dl), fp8)
            return (_normal(k1, (1, d.chunk, d.mla_heads, dl)), lat, *prefill_rows(), sc)

        def gqa_prefill_args(fp8=fp8):
            kp, ks = _pool(k0, (pages1, d.page, d.gqa_hkv, d.head_dim), fp8)
            vp, vs = _pool(k1, (pages1, d.page, d.gqa_hkv, d.head_dim), fp8)
            return (_normal(k1, (1, d.chunk, d.gqa_hq, d.head_dim)), kp, vp, *prefill_rows(), ks, vs)

        mla_row = dl * item + scale_b
        gqa_row = 2 * d.gqa_hkv * (d.head_dim * item + scale_b)  # K and V
        out += [
            Case("paged_mla_decode", f"B{d.batch} N{d.mla_heads} ctx{d.context} {dl} {dt}",
                 jax.jit(lambda q, lat, bt, lens, sc: mla_decode(q, lat, bt, lens, sc, **mla_kw)), mla_decode_args,
                 d.batch * (d.context * mla_row + d.mla_heads * (2 * dl + 4 * d.rank)),
                 2 * d.batch * d.mla_heads * d.context * (dl + d.rank)),
            Case("paged_gqa_decode", f"B{d.batch} Hq{d.gqa_hq}/{d.gqa_hkv} ctx{d.context} d{d.head_dim} {dt}",
                 jax.jit(lambda q, kp, vp, bt, lens, ks, vs: gqa_decode(q, kp, vp, bt, lens, ks, vs, **gqa_kw)),
                 gqa_decode_args, d.batch * (d.context * gqa_row + d.gqa_hq * d.head_dim * 6),
                 4 * d.batch * d.gqa_hq * d.context * d.head_dim),
            Case("paged_prefill_mla", f"T{d.chunk} N{d.mla_heads} ctx{d.context} {dl} {dt}",
                 jax.jit(lambda q, lat, bt, pos, ctx, sc: paged_prefill_mla(q, lat, bt, pos, ctx, sc, backend=backend,
                                                                            **mla_kw)),
                 mla_prefill_args, d.context * mla_row + d.chunk * d.mla_heads * (2 * dl + 4 * d.rank),
                 2 * d.mla_heads * pairs * (dl + d.rank)),
            Case("paged_prefill_gqa", f"T{d.chunk} Hq{d.gqa_hq}/{d.gqa_hkv} ctx{d.context} d{d.head_dim} {dt}",
                 jax.jit(lambda q, kp, vp, bt, pos, ctx, ks, vs: paged_prefill_gqa(
                     q, kp, vp, bt, pos, ctx, ks, vs, backend=backend, **gqa_kw)),
                 gqa_prefill_args, d.context * gqa_row + d.chunk * d.gqa_hq * d.head_dim * 6,
                 4 * d.gqa_hq * pairs * d.head_dim),
        ]
    return out


def matmul_cases(d: Dims, backend: str, interpret: bool) -> list[Case]:
    out = []
    key = jax.random.key(2)
    g = 32
    k, n = d.hidden, 2 * d.ffn  # a fused gate + up projection's shape
    int4 = jax.jit(lambda x, w, s: int4_matmul(x, w, s, backend=backend, interpret=interpret))
    for m in (d.decode_rows // 8, d.prefill_rows // 2):
        def args(m=m):
            return (_normal(key, (m, k)), jax.random.bits(key, (k // 2, n), jnp.uint8),
                    jnp.full((k // g, n), 0.01, jnp.bfloat16))

        out.append(Case("int4_matmul", f"M{m} K{k} N{n} g{g}", int4, args,
                        m * k * 2 + k * n // 2 + (k // g) * n * 2 + m * n * 2, 2 * m * k * n))
    e, kk, nn = d.experts, d.hidden, d.ffn
    for fmt, m in (("int4", d.decode_rows), ("fp8", d.prefill_rows)):
        def args(fmt=fmt, m=m):
            if fmt == "int4":
                w = jax.random.bits(key, (e, kk // 2, nn), jnp.uint8)
                s = jnp.full((e, kk // g, nn), 0.01, jnp.bfloat16)
            else:
                w = jax.random.normal(key, (e, kk, nn), jnp.float32).astype(jnp.float8_e4m3fn)
                s = jnp.full((e, math.ceil(kk / 128), math.ceil(nn / 128)), 0.01, jnp.float32)
            return _normal(key, (m, kk)), w, s, jnp.full((e,), m // e, jnp.int32)  # every expert has rows

        if fmt == "int4":
            w_bytes = e * kk * nn // 2 + e * (kk // g) * nn * 2
        else:
            w_bytes = e * kk * nn + 4 * e * math.ceil(kk / 128) * math.ceil(nn / 128)
        fn = jax.jit(lambda x, w, s, gs, fmt=fmt: moe_gmm(x, w, s, gs, fmt=fmt, backend=backend, interpret=interpret))
        out.append(Case("moe_gmm", f"E{e} M{m} K{kk} N{nn} {fmt}", fn, args, m * kk * 2 + w_bytes + m * nn * 2,
                        2 * (m // e) * e * kk * nn))
    return out


def peaks(kind: str) -> tuple[float | None, float | None]:
    k = kind.lower()
    for sub, v in PEAKS.items():
        if sub in k:
            return v
    return None, None


def measure(case: Case, reps: int, peak_bw: float | None, peak_flops: float | None) -> dict:
    row = {"kernel": case.name, "shape": case.shape, "bytes": case.bytes, "flops": case.flops}
    try:
        args = jax.block_until_ready(jax.jit(case.make)())
        jax.block_until_ready(case.fn(*args))  # compile + first run
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(case.fn(*args))
            times.append(time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001 - a kernel that fails is recorded, the others still run
        return {**row, "status": "error", "error": f"{type(e).__name__}: {str(e)[:400]}",
                "trace": traceback.format_exc()[-1500:]}
    med = statistics.median(times)
    bw, fl = case.bytes / med, case.flops / med
    return {**row, "status": "ok", "median_s": med, "min_s": min(times), "gb_per_s": bw / 1e9,
            "hbm_fraction": None if peak_bw is None else bw / peak_bw, "tflops": fl / 1e12,
            "flops_fraction": None if peak_flops is None else fl / peak_flops}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("gpu", "tpu"), default=None,
                    help="kernel tilings (default: from the JAX backend; gpu on CPU)")
    ap.add_argument("--smoke", action="store_true", help="toy shapes in interpret mode (CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per kernel (default 20; smoke 1)")
    ap.add_argument("--only", default="", help="run only kernels whose name contains this")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    platform = jax.default_backend()
    backend = args.backend or ("tpu" if platform == "tpu" else "gpu")
    interpret = args.smoke or platform == "cpu"
    dims = TOY if args.smoke else REAL
    reps = args.reps or (1 if args.smoke else 20)
    kind = jax.devices()[0].device_kind
    peak_bw, peak_flops = peaks(kind)
    page_dtypes = ("bf16",) if args.smoke else ("bf16", "fp8")  # smoke: compile time is the cost, one of each
    cases = [c for c in attention_cases(dims, backend, interpret, page_dtypes) + matmul_cases(dims, backend, interpret)
             if args.only in c.name]
    rows = [measure(c, reps, peak_bw, peak_flops) for c in cases]
    result = {"machine": common.machine(), "device_kind": kind, "backend": backend, "interpret": interpret,
              "smoke": args.smoke, "reps": reps, "peak_hbm_bytes_per_s": peak_bw, "peak_bf16_flops": peak_flops,
              "dims": vars(dims), "rows": rows}
    lines = [f"{'kernel':18} {'shape':44} {'ms':>9} {'GB/s':>8} {'%HBM':>6} {'TFLOP/s':>8}"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['kernel']:18} {r['shape']:44} ERROR {r['error'][:60]}")
            continue
        frac = "" if r["hbm_fraction"] is None else f"{100 * r['hbm_fraction']:.0f}"
        lines.append(f"{r['kernel']:18} {r['shape']:44} {1e3 * r['median_s']:9.3f} {r['gb_per_s']:8.1f} "
                     f"{frac:>6} {r['tflops']:8.2f}")
    lines.append(f"device {kind}, tilings {backend}{' (interpret)' if interpret else ''}, peak HBM "
                 f"{'?' if peak_bw is None else f'{peak_bw / 1e12:.2f} TB/s'}")
    common.write_result(result, "\n".join(lines), args.json)
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
