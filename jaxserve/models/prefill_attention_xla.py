"""Paged PREFILL attention in plain XLA, blockwise (the engine's XLA prefill path): a `lax.fori_loop` over blocks
of pages with an online softmax, a chunk of T query tokens per row over the row's paged context, f32 results.

Memory grows as chunk x block, and the trip count follows the batch's real context
(cdiv(min(max(positions) + 1, max(ctx_lens)), block)), not the padded table width.

Contract: the one of the flash kernels (`pallas_kernels/paged_prefill.py`) and of their dense oracle
(`pallas_kernels/reference_prefill.py`), whose docstring gives the shapes; in short q MLA [B, T, N, r + dr]
(absorbed) / GQA [B, T, Hq, D]; pages MLA [P, ps, r + dr] / GQA [P, ps, Hkv, D]; fp8 scales f32 [P, ps(, Hkv)];
block_tables [B, M] int32; positions [B, T] int32; ctx_lens [B] int32; -> MLA [B, T, N, r] / GQA [B, T, Hq, D] f32.
Beyond it, the pools may be stored as bit patterns (uint16 for bf16, uint8 for fp8) with `value_dtype` naming
the values: only the gathered rows are bitcast (XLA:CPU cannot gather bf16 / fp8 without converting the whole
operand to f32 first); and they may hold all layers ([L, P, ...], scales likewise) with a static `layer` picked
inside each gather (no layer slice of the pool is materialized).

`dot_dtype` is the operand dtype of the two matmuls (f32 accumulation either way): f32 (the default) is exact up
to f32 rounding; bf16 rounds the query and the softmax weights, as the flash kernels do for bf16 / fp8 pages.
Keys and values lose nothing to it: bf16 and e4m3 values are bf16 values, and fp8 scales multiply the logits and
the softmax weights ([.., block] f32), not the gathered rows. The engine picks it with `prefill_dot_dtype`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def _values(x: jax.Array, value_dtype: jnp.dtype | None) -> jax.Array:
    """Gathered rows: bit patterns viewed as `value_dtype` (a bitcast), or values passed through (None)."""
    return x if value_dtype is None else lax.bitcast_convert_type(x, value_dtype)


def _layer_pool(x: jax.Array | None, layer: int | None) -> jax.Array | None:
    """A pool's one-layer shape (for shape reads only: gathers index the layer themselves)."""
    return x if x is None or layer is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)


def _take(pool: jax.Array | None, ids: jax.Array, layer: int | None) -> jax.Array | None:
    """pool [(L,) P, *rest] at page ids [*I] (of layer `layer` when given) -> [*I, *rest]."""
    if pool is None:
        return None
    return pool[ids] if layer is None else pool[layer, ids]


def _check_bits(pages: jax.Array, value_dtype: jnp.dtype | None) -> None:
    if value_dtype is None:
        if not jnp.issubdtype(pages.dtype, jnp.floating):
            raise ValueError(f"pages of dtype {pages.dtype} are bit patterns: give value_dtype")
        return
    if not jnp.issubdtype(pages.dtype, jnp.unsignedinteger) or \
            jnp.dtype(pages.dtype).itemsize != jnp.dtype(value_dtype).itemsize:
        raise ValueError(f"value_dtype {value_dtype} needs pages stored as unsigned bits of its width, "
                         f"got {pages.dtype}")


def _pin(pools, i: jax.Array):
    """Tie the page pools to the loop index i inside the loop body.

    XLA:CPU upcasts bf16/fp8 gathers to f32 (float normalization) and loop-invariant code motion then hoists that
    convert of the WHOLE pool out of the loop: a pool-sized f32 copy per call. Through a barrier with the loop
    index the convert stays in the body, fused into the gather (only gathered rows are converted).
    """
    return lax.optimization_barrier((pools, i))[0]


def _visible(kpos: jax.Array, positions: jax.Array, ctx_lens: jax.Array) -> jax.Array:
    """kpos [S] int32, positions [B, T], ctx_lens [B] -> [B, T, S] bool (the causal rule)."""
    return (kpos[None, None, :] <= positions[:, :, None]) & (kpos[None, None, :] < ctx_lens[:, None, None])


def _grouped(q: jax.Array, hkv: int) -> jax.Array:
    """q [B, T, H, D] -> [B, T, Hkv, G, D] f32 (query head h uses kv head h // G)."""
    b, t, h, d = q.shape
    return q.astype(jnp.float32).reshape(b, t, hkv, h // hkv, d)


def _clip_lens(ctx_lens: jax.Array, block_tables: jax.Array, page_size: int) -> jax.Array:
    return jnp.clip(ctx_lens.astype(jnp.int32), 0, block_tables.shape[1] * page_size)


def _check_mla(q: jax.Array, pages: jax.Array, kv_lora_rank: int) -> None:
    if q.shape[-1] != pages.shape[-1] or not 0 < kv_lora_rank < q.shape[-1]:
        raise ValueError(f"q {q.shape}, pages {pages.shape}, kv_lora_rank {kv_lora_rank}")


def _check_gqa(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> None:
    if k_pages.shape != v_pages.shape or q.shape[-1] != k_pages.shape[-1] or q.shape[2] % k_pages.shape[2]:
        raise ValueError(f"q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape}")


def block_pages_for(page_size: int, chunk: int = 256) -> int:
    """Pages per key block of the blockwise path for a chunk of `chunk` queries: ~min(256, max(64, chunk)) keys,
    at least one page. A short chunk usually has a short context: a 256-key block for a 64-token prompt computed
    4x the logits it needed (3.75 vs 1.25 ms a layer at 8 x 64 queries on one CPU core); long chunks keep 256,
    where each trip's fixed cost is amortized."""
    return max(1, min(256, max(64, chunk)) // page_size)


def _blockwise(qg: jax.Array, load, positions: jax.Array, ctx_lens: jax.Array, num_table_pages: int,
               page_size: int, block_pages: int, value_dim: int, softmax_scale: float,
               dot_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Online softmax over key blocks of `block_pages` pages.

    qg [B, T, Hkv, G, Dk] f32; load(cols [block_pages] int32 table columns, i loop index) -> (k [B, bk, Hkv, Dk],
    v [B, bk, Hkv, Dv] `dot_dtype` values, k_scale, v_scale [B, bk, Hkv] f32 | None: fp8 scales); ctx_lens already
    clipped. Both matmuls take `dot_dtype` operands and accumulate in f32; the softmax is f32.
    -> [B, T, Hkv, G, Dv] f32.
    The loop works on [B, Hkv, T * G, ...]: each block is two plain batched matmuls. (The 5-D einsums over
    [B, T, Hkv, G, ...] ran 3x slower on XLA:CPU: 24 vs 7.8 ms for 256 queries x 4 heads over 2000 keys.)
    """
    b, t, hkv, g, dk = qg.shape
    bk = block_pages * page_size
    q = jnp.moveaxis(qg, 2, 1).reshape(b, hkv, t * g, dk).astype(dot_dtype)  # row t * G + g: token t, head g
    # trip count from the batch's real context: the last key any query can see, not the table width
    limit = jnp.minimum(jnp.max(positions) + 1, jnp.max(ctx_lens))
    n_blocks = jnp.clip(-(-limit // bk), 0, -(-num_table_pages // block_pages))

    def body(i, carry):
        acc, m, l = carry
        cols = i * block_pages + jnp.arange(block_pages, dtype=jnp.int32)
        # columns past the table read its last entry; their keys sit past every ctx_len and are masked
        k, v, ks, vs = load(jnp.minimum(cols, num_table_pages - 1), i)
        k, v = jnp.moveaxis(k, 2, 1), jnp.moveaxis(v, 2, 1)  # [B, Hkv, bk, D]
        kpos = i * bk + jnp.arange(bk, dtype=jnp.int32)
        live = (kpos[None, :] < ctx_lens[:, None])[:, None, :]  # [B, 1, bk]
        visible = _visible(kpos, positions, ctx_lens)[:, None, :, None, :]  # [B, 1, T, 1, bk]
        mask = jnp.broadcast_to(visible, (b, 1, t, g, bk)).reshape(b, 1, t * g, bk)
        logits = jnp.einsum("bkqd,bksd->bkqs", q, k, precision=_HI, preferred_element_type=jnp.float32) * softmax_scale
        if ks is not None:
            logits = logits * jnp.moveaxis(ks, 2, 1)[:, :, None, :]  # NaN past ctx_len is masked just below
        logits = jnp.where(mask, logits, -jnp.inf)
        m_next = jnp.maximum(m, logits.max(axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_next), m_next, 0.0)  # no key seen yet: keep exp() finite
        corr = jnp.exp(m - m_safe)
        p = jnp.exp(logits - m_safe[..., None])  # masked entries are exp(-inf) = 0
        v = jnp.where(live[..., None], v, 0)  # NaN past ctx_len: 0 * NaN would leak
        pv = p if vs is None else p * jnp.where(live, jnp.moveaxis(vs, 2, 1), 0.0)[:, :, None, :]
        acc = corr[..., None] * acc + jnp.einsum("bkqs,bksd->bkqd", pv.astype(dot_dtype), v, precision=_HI,
                                                 preferred_element_type=jnp.float32)
        return acc, m_next, corr * l + p.sum(axis=-1)

    init = (jnp.zeros((b, hkv, t * g, value_dim), jnp.float32), jnp.full((b, hkv, t * g), -jnp.inf, jnp.float32),
            jnp.zeros((b, hkv, t * g), jnp.float32))
    acc, _, l = lax.fori_loop(0, n_blocks, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return jnp.moveaxis(out.reshape(b, hkv, t, g, value_dim), 1, 2)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale", "block_pages", "value_dtype", "layer",
                                             "dot_dtype"))
def prefill_mla_blockwise(q: jax.Array, pages: jax.Array, block_tables: jax.Array, positions: jax.Array,
                          ctx_lens: jax.Array, scales: jax.Array | None = None, *, kv_lora_rank: int,
                          softmax_scale: float, block_pages: int | None = None,
                          value_dtype: jnp.dtype | None = None, layer: int | None = None,
                          dot_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Absorbed MLA prefill, blockwise online softmax (the engine's XLA path).

    Shapes in the module docstring; block_pages: pages per key block (default `block_pages_for`); value_dtype: the
    value dtype of a pool stored as bits (None: `pages` holds values); layer: pools of all layers, this one read;
    dot_dtype: the matmuls' operand dtype (module docstring).
    Peak temporaries ~ B * T * N * (block + kv_lora_rank) f32, independent of the context.
    -> [B, T, N, kv_lora_rank] f32.
    """
    all_layers = pages
    pages = _layer_pool(pages, layer)
    _check_mla(q, pages, kv_lora_rank)
    _check_bits(pages, value_dtype)
    page_size = pages.shape[1]
    bp = block_pages or block_pages_for(page_size, q.shape[1])
    bt = block_tables.astype(jnp.int32)

    def load(cols, i):
        ids = bt[:, cols]  # [B, bp]
        pool, sc = _pin((all_layers, scales), i)
        c = _values(_take(pool, ids, layer), value_dtype).astype(dot_dtype)  # [B, bp, ps, Dl]
        c = c.reshape(c.shape[0], bp * page_size, 1, c.shape[-1])
        s = _take(sc, ids, layer)
        s = None if s is None else s.astype(jnp.float32).reshape(c.shape[0], bp * page_size, 1)
        return c, c[..., :kv_lora_rank], s, s

    out = _blockwise(_grouped(q, 1), load, positions.astype(jnp.int32), _clip_lens(ctx_lens, bt, page_size),
                     bt.shape[1], page_size, bp, kv_lora_rank, softmax_scale, dot_dtype)
    return out[:, :, 0]


@functools.partial(jax.jit, static_argnames=("softmax_scale", "block_pages", "value_dtype", "layer", "dot_dtype"))
def prefill_gqa_blockwise(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                          positions: jax.Array, ctx_lens: jax.Array, k_scales: jax.Array | None = None,
                          v_scales: jax.Array | None = None, *, softmax_scale: float,
                          block_pages: int | None = None, value_dtype: jnp.dtype | None = None,
                          layer: int | None = None, dot_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """GQA prefill, blockwise online softmax (the engine's XLA path).

    Shapes in the module docstring; block_pages: pages per key block (default `block_pages_for`); value_dtype, layer and
    dot_dtype as in `prefill_mla_blockwise`.
    Peak temporaries ~ B * T * Hq * (block + D) f32, independent of the context. -> [B, T, Hq, D] f32.
    """
    pools = (k_pages, v_pages, k_scales, v_scales)
    k_pages, v_pages = _layer_pool(k_pages, layer), _layer_pool(v_pages, layer)
    _check_gqa(q, k_pages, v_pages)
    _check_bits(k_pages, value_dtype)
    _, page_size, hkv, d = k_pages.shape
    bp = block_pages or block_pages_for(page_size, q.shape[1])
    bt = block_tables.astype(jnp.int32)

    def load(cols, i):
        ids = bt[:, cols]
        kp, vp, ksc, vsc = _pin(pools, i)
        k = _values(_take(kp, ids, layer), value_dtype).astype(dot_dtype)  # [B, bp, ps, Hkv, D]
        v = _values(_take(vp, ids, layer), value_dtype).astype(dot_dtype)
        shape = (k.shape[0], bp * page_size, hkv, d)
        scale = lambda x: None if x is None else x.astype(jnp.float32).reshape(shape[:3])  # noqa: E731
        return k.reshape(shape), v.reshape(shape), scale(_take(ksc, ids, layer)), scale(_take(vsc, ids, layer))

    out = _blockwise(_grouped(q, hkv), load, positions.astype(jnp.int32), _clip_lens(ctx_lens, bt, page_size),
                     bt.shape[1], page_size, bp, d, softmax_scale, dot_dtype)
    return out.reshape(q.shape)


def prefill_dot_dtype(activations: jnp.dtype, values: jnp.dtype) -> jnp.dtype:
    """The XLA prefill attention's matmul operand dtype: bf16 for a model computing in bf16 (its query already comes
    out of bf16 matmuls) over bf16 / fp8 pages (bf16 holds those values exactly), as the flash kernels; f32 otherwise,
    so an f32 model stays exact. bf16 dots ran 1.4x faster than f32 on the CPU host (AVX-512 BF16)."""
    low = jnp.dtype(activations).itemsize <= 2 and jnp.dtype(values).itemsize <= 2
    return jnp.dtype(jnp.bfloat16) if low else jnp.dtype(jnp.float32)
