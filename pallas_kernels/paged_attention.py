"""Paged decode attention (one query token per sequence) for MLA (absorbed, MQA over the latent) and GQA, written
for the Pallas Triton lowering (GPU).

Pages are read through the block table from the whole pool [layers, pages, page_size, ...] at a layer handed in as
a [1] int32 input (read as a scalar; a one-layer pool is given a unit layer axis): a layer slice handed to a Triton
call is copied by XLA:GPU into its own buffer (946 MB per layer and step at Kimi K2.6's H200 pool). Over 2^32 bytes
Pallas' Triton lowering computes the offsets in 64 bits by itself. Pages may be the pool's bit patterns (uint8 /
uint16), bitcast to float8_e4m3fn / bfloat16 once loaded. BF16 or FP8 e4m3 pages are dequantized inside the kernel
with the per-token (MLA) or per-token-and-head (GQA) f32 scales loaded beside them: K scales multiply the logits,
V scales multiply the probabilities. Online softmax over blocks of pages, split-K over the sequence
(flash-decoding), the splits merged by log-sum-exp in XLA. Ragged lengths in one batch; a length of 0 gives an
output of 0.

Grid: MLA (batch, head block, split); GQA (batch, kv head, split), one kv head's query group per program.

FP8 MLA layout: one f32 scale per token over the whole 576-wide row (580 B/token/layer). FlashMLA's layout (512
FP8 + one scale per 128 columns + the 64 rope columns in BF16, 656 B) was measured against it
(`python bench/kv_layout_quality.py`, bench/results/kv_layout_quality.json; embedded tiny-kimi, 16 x 256 held-out
tokens, vs BF16 KV): top-1 0.973 -> 0.993, mean KL 0.0022 -> 0.0003, at 1.13x fewer tokens per byte. The loss
comes from the rope columns in FP8 (two scales, c_kv and rope, measure the same as one). The default stays
per-token: the switch changes the pool layout, the hand-off, the XLA decode path and all four attention kernels
(a rope-in-BF16 row of 512 + 4 + 128 B is the cheapest variant that keeps the gain, not built).

Lowering: every pallas_call passes `pallas.triton.CompilerParams(num_warps, num_stages)`. Without compiler
params JAX 0.10.2 lowers a GPU pallas_call with Mosaic GPU, which treats the whole-pool BlockSpec as one
shared-memory block ("Mosaic GPU kernel exceeds available shared memory: smem_bytes=38089736"); with them it is
the Triton lowering this kernel is written for. num_warps / num_stages come from `_TRITON_TABLE`, keyed by
(head block, loaded width per token, page size, pages per compute block); its entries are starting points chosen
from JAX's own Triton decode kernels and the shared-memory model below, NOT tuned on a GPU. `choose_blocks`
shrinks pages_per_compute_block until `smem_bytes` (a model: num_stages copies of the tiles the loop loads, in
the page dtype, plus one copy of the dot operands converted to the compute dtype, q and p) fits the H200's
232,448 bytes, then reads one page per step in 2, 4, .. parts (`page_splits`: a 64-token page of a 576-wide
latent beside its f32 copy does not fit). Modelled at batch 64, 262,144 tokens: MLA 130-186 KB, GQA 90-177 KB.
`compute_dtype` (default q.dtype) sets the dot operand dtype: bf16 halves the converted copy of an f32 query.

Deprecation: the Pallas Triton backend is deprecated upstream as of JAX 0.11.0 (and JAX's own Triton ops point
to tokamax). Path forward, NOT built: a Mosaic GPU (`pallas.mosaic_gpu`) variant for Hopper, with pages in GMEM
(`memory_space=ANY`-style refs), per-page TMA copies into a multi-slot SMEM ring driven by barriers, the head
block (8 local heads padded to a 64-row wgmma tile) times the latent as the wgmma shape, and the block table
read from SMEM in chunks; it can only be validated on a device.

What was checked: CPU only, legacy `interpret=True`, against `reference_paged.py` (tests/test_paged_attention.py:
toy dims with page sizes 8 and 16, batch 1 and 3, ragged lengths 0..several pages, bf16 and fp8, random
non-contiguous block tables; and the real per-device dims: MLA 8 heads x (512 + 64), GQA 12 q / 1 kv heads x
128, bf16 and fp8). Cross-lowering for `cuda` with `jax.export` on CPU (tests/test_lowering_attention.py: Kimi
K2.6 / GLM-5.2 / GLM-4.5 per-device and unsharded shapes, page 16 and 64, batch 1..64, block tables up to
262,144 tokens): this runs the Pallas -> Triton IR lowering only. Compiled by XLA:GPU + Triton for an H200
(sm_90a) on the CPU host (tests/compile): Kimi K2.6 / GLM-5.2 MLA TP and DP, GLM-4.5 GQA TP and DP, bf16 and fp8,
page 16 and 64, all fit; the shared memory Triton allocates is below the model's count (MLA 1.1-1.3x, GQA
2.3-2.5x over), so `_MEASURED_SMEM` (the compiler's bytes, checked against it in tests/compile) takes precedence
in choose_blocks. The whole-pool form: interpret tests at layer 2 of a 3-layer bits pool (NaN in the other layers),
and an H200 compile over a > 4 GB FP8 bits pool at a traced layer (same shared memory as one layer; the PTX's
address arithmetic differs from a 0.6 GB pool's: the 64-bit offsets). What was NOT checked: running on any GPU,
register pressure, speed. No GPU was available.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.paged_attention_tpu import BITS_TO_VALUES

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


# H200 (sm_90) opt-in shared memory per thread block.
SMEM_BUDGET_BYTES = 232_448
TARGET_PROGRAMS = 128  # split the sequence until the grid reaches ~ one program per SM (H100 / H200: 132)
# (block_h, loaded width per token, page_size, pages_per_compute_block) -> (num_warps, num_stages). Priors from
# JAX's Triton decode kernels (4-8 warps, 2 stages) and the smem model; not measured on a GPU.
_TRITON_TABLE: dict[tuple[int, int, int, int], tuple[int, int]] = {
    (16, 576, 16, 2): (4, 2),  # MLA 512 + 64, 32-token blocks
    (16, 576, 16, 4): (4, 2),  # MLA, 64-token blocks (fp8 pages, bf16 q)
    (16, 576, 64, 1): (4, 2),
    (16, 256, 16, 4): (4, 3),  # GQA head_dim 128 (K + V = 256 per token), 64-token blocks
    (16, 256, 64, 1): (4, 3),
}
_DEFAULT_TRITON = (4, 2)
# Shared memory XLA:GPU's Triton compile allocates (sm_90a, jaxlib 0.10.2; tests/compile checks every default choice
# against the compiler), with the launch parameters choose_blocks gives them. It overrides the model where known: the
# model over-counts (MLA 1.1-1.3x, GQA 2.3-2.5x) and so halved the fp8 MLA steps the compiler accepts.
_MEASURED_PAGE_DTYPES = ("bfloat16", "float8_e4m3fn")
_MEASURED_SMEM: dict[tuple[int, int, int, str], dict[tuple[int, int], tuple[int | None, int]]] = {
    # (block_h, loaded width, page_size, compute dtype): {(pages_per_compute_block, page_splits): (bf16 pages,
    # fp8 pages)}. MLA TP (8 heads padded to 16): 32-token steps; (4, 1) bf16 is over the H200's 232,448: refused
    (16, 576, 16, "float32"): {(2, 1): (141_312, 123_008), (4, 1): (245_760, 209_152)},
    (16, 576, 64, "float32"): {(1, 2): (141_312, 123_008), (1, 1): (245_760, 209_152)},
    # MLA DP (64 heads): 16-token steps
    (64, 576, 16, "float32"): {(1, 1): (198_656, 189_504), (2, 1): (249_856, 231_552), (4, 1): (None, 315_648)},
    (64, 576, 64, "float32"): {(1, 4): (198_656, 189_504), (1, 2): (249_856, 231_552), (1, 1): (None, 315_648)},
    # GQA head_dim 128 (k and v loaded: width 256): 64-token steps
    (16, 256, 16, "bfloat16"): {(4, 1): (55_312, 39_456)},
    (16, 256, 64, "bfloat16"): {(1, 1): (55_300, 39_444)},
}


@dataclass(frozen=True)
class DecodeBlocks:
    """Static tiling: query heads per program, pages per inner step, sequence splits, and Triton's launch
    parameters (warps per program, software-pipelining stages of the inner loop's loads)."""

    block_h: int
    pages_per_compute_block: int
    k_splits: int
    num_warps: int = _DEFAULT_TRITON[0]
    num_stages: int = _DEFAULT_TRITON[1]
    page_splits: int = 1  # > 1 (with one page per step): each page is read in page_splits parts

    def tokens_per_step(self, page_size: int) -> int:
        return self.pages_per_compute_block * page_size // self.page_splits


Tile = tuple[tuple[int, ...], jnp.dtype]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def smem_tiles(blocks: DecodeBlocks, page_size: int, *, kv_widths: tuple[int, ...], q_width: int, kv_dtype,
               q_dtype, n_scales: int) -> tuple[list[Tile], list[Tile]]:
    """Shared-memory model of one program: (tiles loaded per pipeline stage, tiles staged once).

    Per stage (times num_stages): each K/V part [bk, width] in the page dtype, n_scales f32 scale rows [bk], the
    page ids [ppcb] int32. Once: the same parts converted to the query dtype (dot B operands), q [bh, q_width]
    and p [bh, bk] in the query dtype.
    """
    bk = blocks.tokens_per_step(page_size)
    staged = [((bk, w), kv_dtype) for w in kv_widths] + [((bk,), jnp.float32)] * n_scales
    staged.append(((blocks.pages_per_compute_block,), jnp.int32))
    once = [((bk, w), q_dtype) for w in kv_widths] + [((blocks.block_h, q_width), q_dtype),
                                                      ((blocks.block_h, bk), q_dtype)]
    return staged, once


def smem_bytes(blocks: DecodeBlocks, page_size: int, **tile_kwargs) -> int:
    """Modelled shared-memory bytes of one program (see smem_tiles)."""
    staged, once = smem_tiles(blocks, page_size, **tile_kwargs)
    size = lambda tiles: sum(math.prod(shape) * jnp.dtype(dt).itemsize for shape, dt in tiles)  # noqa: E731
    return blocks.num_stages * size(staged) + size(once)


def measured_smem(blocks: DecodeBlocks, page_size: int, *, kv_widths: tuple[int, ...], kv_dtype, q_dtype,
                  **_) -> int | None:
    """The compiler's shared memory for these blocks from _MEASURED_SMEM, None if not measured (launch parameters
    other than choose_blocks' defaults are not measured)."""
    if (blocks.num_warps, blocks.num_stages) != _TRITON_TABLE.get(
            (blocks.block_h, sum(kv_widths), page_size, blocks.pages_per_compute_block), _DEFAULT_TRITON):
        return None
    steps = _MEASURED_SMEM.get((blocks.block_h, sum(kv_widths), page_size, jnp.dtype(q_dtype).name), {})
    by_dtype = steps.get((blocks.pages_per_compute_block, blocks.page_splits))
    page_dtype = jnp.dtype(kv_dtype).name
    if by_dtype is None or page_dtype not in _MEASURED_PAGE_DTYPES:
        return None
    return by_dtype[_MEASURED_PAGE_DTYPES.index(page_dtype)]


def smem_estimate(blocks: DecodeBlocks, page_size: int, **tile_kwargs) -> int:
    """Shared memory of these blocks: the compiler's (measured_smem) where known, else the model (smem_bytes)."""
    measured = measured_smem(blocks, page_size, **tile_kwargs)
    return smem_bytes(blocks, page_size, **tile_kwargs) if measured is None else measured


def choose_blocks(page_size: int, max_pages: int, heads_per_program: int, *, block_h: int | None = None,
                  pages_per_compute_block: int | None = None, k_splits: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, page_splits: int | None = None,
                  kv_widths: tuple[int, ...] = (64,), q_width: int = 64, kv_dtype=jnp.bfloat16,
                  q_dtype=jnp.bfloat16, n_scales: int = 0, batch: int = 1) -> DecodeBlocks:
    """Default tiling; any argument given overrides it.

    block_h: power of two >= 16 (Triton's dot minimum), at most 64. Inner step ~64 tokens, halved while the
    shared memory (smem_estimate: the compiler's where measured, else the model) exceeds SMEM_BUDGET_BYTES: first fewer pages per step, then (one page per step) the page
    read in 2, 4, .. parts of >= 16 tokens. Splits: each split keeps at least 4 inner steps, at most 16 splits,
    and no more than it takes batch x head blocks x splits to reach TARGET_PROGRAMS (the GPU is then full; a
    further split only adds f32 partials for the merge to read). batch: the grid's sequences (GQA: x kv heads).
    num_warps / num_stages: `_TRITON_TABLE`, else (4, 2). kv_widths, q_width, kv_dtype, q_dtype, n_scales: the
    loaded shapes, as in smem_tiles.
    """
    bh = block_h or min(64, max(16, _next_pow2(heads_per_program)))
    ppcb = pages_per_compute_block or min(max(1, 64 // page_size), _next_pow2(max_pages))
    splits = page_splits or 1
    tiles = dict(kv_widths=kv_widths, q_width=q_width, kv_dtype=kv_dtype, q_dtype=q_dtype, n_scales=n_scales)

    def make(p: int, sp: int, ks: int = 1) -> DecodeBlocks:
        warps, stages = _TRITON_TABLE.get((bh, sum(kv_widths), page_size, p), _DEFAULT_TRITON)
        return DecodeBlocks(bh, p, ks, num_warps or warps, num_stages or stages, sp)

    def over(p: int, sp: int) -> bool:
        return smem_estimate(make(p, sp), page_size, **tiles) > SMEM_BUDGET_BYTES

    # a 576-wide latent block must fit beside its copy converted to the query dtype
    while pages_per_compute_block is None and ppcb > 1 and over(ppcb, splits):
        ppcb //= 2
    while page_splits is None and ppcb == 1 and page_size // splits > 16 and over(ppcb, splits):
        splits *= 2
    if page_size % splits or (splits > 1 and ppcb != 1):
        raise ValueError(f"page_splits {splits} must divide page_size {page_size}, with one page per step")
    steps = -(-max_pages // ppcb) * splits
    ks = k_splits or min(16, max(1, _next_pow2(steps // 4 + 1) // 2))
    while k_splits is None and ks > 1 and batch * -(-heads_per_program // bh) * ks // 2 >= TARGET_PROGRAMS:
        ks //= 2
    return make(ppcb, splits, ks)


def _decode_kernel(bt_ref, len_ref, layer_ref, *refs, mla: bool, fp8: bool, value_dim: int, page_size: int,
                   pages_per_compute_block: int, page_splits: int, softmax_scale: float, value_dtype,
                   block_h: int = 0):
    """One (sequence, head block, split) program. layer_ref [1] int32: the pool layer every page ref is read at.

    MLA refs: q [B, H, Dv+Dr] (whole: this program gathers its block_h head rows, those past H repeat row H - 1,
    so no padded copy of q exists), latent pages [L, P, ps, Dv+Dr], (scales [L, P, ps]), outputs.
    GQA refs: q [bh, D], k pages [L, P, ps, D], v pages [L, P, ps, D], (k scales, v scales [L, P, ps]), outputs.
    Pages may be bit patterns (uint8 / uint16): bitcast to value_dtype once loaded.
    Outputs: o [bh, Dv] f32 (unnormalized), l [bh] f32 (sum of exp), m [bh] f32 (running max).
    """
    if mla:
        q_ref, kv_ref, *rest = refs
        s_ref, o_ref, l_ref, m_ref = rest if fp8 else (None, *rest)
    else:
        q_ref, k_ref, v_ref, *rest = refs
        ks_ref, vs_ref, o_ref, l_ref, m_ref = rest if fp8 else (None, None, *rest)
    split = pl.program_id(2)
    pages_per_split = bt_ref.shape[0]
    sub_k = page_size // page_splits  # tokens per page per step (page_splits > 1 only with one page per step)
    block_k = pages_per_compute_block * sub_k
    length = len_ref[0]
    layer = layer_ref[0]
    first_page = split * pages_per_split
    n_tokens = jnp.clip(length - first_page * page_size, 0, pages_per_split * page_size)
    n_steps = pl.cdiv(n_tokens, block_k)

    if mla:
        heads = lax.broadcasted_iota(jnp.int32, (block_h,), 0) + pl.program_id(1) * block_h
        heads = jnp.minimum(heads, q_ref.shape[1] - 1)
        q = q_ref[pl.program_id(0), heads, pl.ds(0, value_dim)]
        qr = q_ref[pl.program_id(0), heads, pl.ds(value_dim, q_ref.shape[2] - value_dim)]
    else:
        q, qr = q_ref[...], None
        block_h = q.shape[0]

    def rows(ref, i, *trailing):
        """Step i's tokens of layer `layer` of a [L, P, ps, ...] ref -> [block_k, ...] (values): a vector gather of
        whole pages, or one page (scalar id) sliced into page_splits parts."""
        if page_splits == 1:
            ids = bt_ref[pl.ds(i * pages_per_compute_block, pages_per_compute_block)]
            x = ref[(layer, ids, slice(None), *trailing)]
            x = x.reshape(block_k, *x.shape[2:])
        else:
            # lax.div / lax.rem: i >= 0, and jnp's floor-mod sign fix-up does not lower to Triton
            page, part = lax.div(i, page_splits), lax.rem(i, page_splits)
            x = ref[(layer, bt_ref[page], pl.ds(part * sub_k, sub_k), *trailing)]
        return x if x.dtype in (jnp.float32, value_dtype) else lax.bitcast_convert_type(x, value_dtype)

    def load(i):
        """-> (logits [bh, bk] f32 before scaling, v [bk, Dv] in q dtype, v_scale [1, bk] f32 | None)."""
        if mla:
            c = rows(kv_ref, i, pl.ds(0, value_dim)).astype(q.dtype)
            cr = rows(kv_ref, i, pl.ds(value_dim, qr.shape[-1])).astype(q.dtype)
            logits = (jnp.dot(q, c.T, preferred_element_type=jnp.float32)
                      + jnp.dot(qr, cr.T, preferred_element_type=jnp.float32))
            scale = rows(s_ref, i).reshape(1, block_k) if fp8 else None
            return (logits if scale is None else logits * scale), c, scale
        k = rows(k_ref, i).astype(q.dtype)
        v = rows(v_ref, i).astype(q.dtype)
        logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
        if fp8:
            logits = logits * rows(ks_ref, i).reshape(1, block_k)
        return logits, v, (rows(vs_ref, i).reshape(1, block_k) if fp8 else None)

    def body(i, carry):
        o_prev, m_prev, l_prev = carry
        logits, v, v_scale = load(i)
        tok = first_page * page_size + i * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        valid = tok < length  # [1, bk]
        logits = jnp.where(valid, logits * softmax_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        correction = jnp.exp2((m_prev - m_next) * _LOG2E)
        p = jnp.exp2((logits - m_next[:, None]) * _LOG2E)  # masked entries underflow to exactly 0
        l_next = correction * l_prev + p.sum(axis=-1)
        if v_scale is not None:
            p = p * v_scale
        # zero masked V rows: tail pages may hold anything (NaN included) and 0 * NaN would leak
        v = jnp.where(valid.reshape(block_k, 1), v, jnp.zeros((), v.dtype))
        o_next = correction[:, None] * o_prev + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o_next, m_next, l_next

    init = (jnp.zeros((block_h, value_dim), jnp.float32), jnp.full((block_h,), jnp.finfo(jnp.float32).min),
            jnp.zeros((block_h,), jnp.float32))
    o, m, l = lax.fori_loop(0, n_steps, body, init)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def _merge_splits(o: jax.Array, l: jax.Array, m: jax.Array) -> jax.Array:
    """o [S, ..., Dv], l/m [S, ...] -> [..., Dv] f32; rows with no tokens (l == 0 everywhere) give 0."""
    m_all = m.max(axis=0)
    corr = jnp.exp(m - m_all[None])
    l_all = (l * corr).sum(axis=0)
    o_all = (o * corr[..., None]).sum(axis=0)
    return jnp.where(l_all[..., None] > 0, o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)


def _prepare_tables(block_tables: jax.Array, lengths: jax.Array, page_size: int,
                    blocks: DecodeBlocks) -> tuple[jax.Array, jax.Array, int]:
    """Pad block tables [B, M] with page 0 to k_splits * pages_per_split; clip lengths to the table's capacity."""
    b, m = block_tables.shape
    steps = -(-m // blocks.pages_per_compute_block)
    pages_per_split = -(-steps // blocks.k_splits) * blocks.pages_per_compute_block
    padded = blocks.k_splits * pages_per_split
    bt = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded - m)))  # page 0 = null page, masked
    lens = jnp.clip(lengths.astype(jnp.int32), 0, m * page_size).reshape(b, 1)
    return bt, lens, pages_per_split


def with_layer_axis(pages: jax.Array, one_layer_ndim: int, layer: int | jax.Array | None,
                     scales: tuple[jax.Array | None, ...]) -> tuple[jax.Array, tuple, jax.Array, jnp.dtype]:
    """One layer (layer None: a free leading unit layer axis on pages and scales) or the whole pool [L, ...] with
    `layer` -> (pages [L, ...], scales [L, ...] f32 | None, layer [1] int32, the pages' value dtype: bits are
    viewed as float8_e4m3fn / bfloat16 inside the kernel)."""
    if (layer is None) != (pages.ndim == one_layer_ndim):
        raise ValueError(f"pages {pages.shape}: pass one layer ({one_layer_ndim} dims), or the pool with a leading "
                         f"layer axis and `layer`")
    if layer is None:
        pages, scales, layer = pages[None], tuple(None if s is None else s[None] for s in scales), 0
    for s in scales:
        if s is not None and s.shape != pages.shape[:s.ndim]:
            raise ValueError(f"scales {s.shape} do not match pages {pages.shape}")
    scales = tuple(None if s is None else s.astype(jnp.float32) for s in scales)
    value_dtype = jnp.dtype(BITS_TO_VALUES.get(jnp.dtype(pages.dtype), pages.dtype))
    return pages, scales, jnp.asarray(layer, jnp.int32).reshape(1), value_dtype


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale", "block_h", "pages_per_compute_block",
                                             "k_splits", "num_warps", "num_stages", "page_splits",
                                             "compute_dtype", "interpret", "out_dtype"))
def paged_mla_decode(q: jax.Array, pages: jax.Array, block_tables: jax.Array, lengths: jax.Array,
                     scales: jax.Array | None = None, *, layer: int | jax.Array | None = None,
                     kv_lora_rank: int, softmax_scale: float,
                     block_h: int | None = None, pages_per_compute_block: int | None = None,
                     k_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     page_splits: int | None = None, compute_dtype: jnp.dtype | None = None,
                     interpret: bool = False, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Absorbed MLA decode attention over paged latents.

    q: [batch, heads, latent_dim] bf16|f32 (absorbed nope part then rope part); pages: [num_pages, page_size,
    latent_dim] bf16|float8_e4m3fn (one layer); scales: [num_pages, page_size] f32 for fp8 pages, else None; or
    the whole pool [layers, num_pages, page_size, latent_dim] (scales [layers, num_pages, page_size]) with `layer`
    (int or int32 scalar): the kernel reads that layer from the pool itself, so XLA:GPU materializes no layer slice
    (it gave a sliced custom-call operand its own buffer: 946 MB per layer at Kimi K2.6's H200 pool). Pages may
    be the pool's bit patterns (uint8 for float8_e4m3fn, uint16 for bf16), viewed as values once loaded.
    block_tables: [batch, max_pages] int32 (valid ids; padding 0); lengths: [batch] int32 (0 allowed).
    logits = (q . latent) * softmax_scale; value = latent[:kv_lora_rank].
    compute_dtype: dtype of the dot operands (q and the dequantized pages; default q.dtype, e.g. bf16 for an f32
    q halves the staged operands). Tiling overrides (block_h, pages_per_compute_block, k_splits, num_warps,
    num_stages, page_splits): see choose_blocks. Returns [batch, heads, kv_lora_rank] in out_dtype (default
    q.dtype).
    """
    out_dtype = out_dtype or q.dtype
    q = q.astype(compute_dtype or q.dtype)
    b, h, dl = q.shape
    pages, (scales,), layer, value_dtype = with_layer_axis(pages, 3, layer, (scales,))
    n_layers, num_pages, page_size, dl_p = pages.shape
    if dl != dl_p or not 0 < kv_lora_rank < dl:
        raise ValueError(f"q latent dim {dl}, pages latent dim {dl_p}, kv_lora_rank {kv_lora_rank}")
    fp8 = scales is not None
    blocks = choose_blocks(page_size, block_tables.shape[1], h, block_h=block_h,
                           pages_per_compute_block=pages_per_compute_block, k_splits=k_splits, num_warps=num_warps,
                           num_stages=num_stages, page_splits=page_splits,
                           kv_widths=(kv_lora_rank, dl - kv_lora_rank), q_width=dl,
                           kv_dtype=value_dtype, q_dtype=q.dtype, n_scales=int(fp8),
                           batch=b)
    bt, lens, pps = _prepare_tables(block_tables, lengths, page_size, blocks)
    hp = -(-h // blocks.block_h) * blocks.block_h
    bh, s = blocks.block_h, blocks.k_splits
    kernel = functools.partial(_decode_kernel, mla=True, fp8=fp8, value_dim=kv_lora_rank, page_size=page_size,
                               pages_per_compute_block=blocks.pages_per_compute_block,
                               page_splits=blocks.page_splits, softmax_scale=softmax_scale, value_dtype=value_dtype,
                               block_h=bh)
    pool = (n_layers, num_pages, page_size)
    in_specs = [
        pl.BlockSpec((None, pps), lambda i, j, k: (i, k)),  # block table slice of this split
        pl.BlockSpec((None, 1), lambda i, j, k: (i, 0)),  # length
        pl.BlockSpec((1,), lambda i, j, k: (0,)),  # layer
        pl.BlockSpec(q.shape, lambda i, j, k: (0, 0, 0)),  # whole q: each program gathers its head rows
        pl.BlockSpec((*pool, dl), lambda i, j, k: (0, 0, 0, 0)),  # whole pool: gathered by layer and page id
    ]
    args = [bt, lens, layer, q, pages]
    if fp8:
        in_specs.append(pl.BlockSpec(pool, lambda i, j, k: (0, 0, 0)))
        args.append(scales)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(b, hp // bh, s),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, bh, kv_lora_rank), lambda i, j, k: (k, i, j, 0)),
                   pl.BlockSpec((None, None, bh), lambda i, j, k: (k, i, j)),
                   pl.BlockSpec((None, None, bh), lambda i, j, k: (k, i, j))],
        out_shape=[jax.ShapeDtypeStruct((s, b, hp, kv_lora_rank), jnp.float32),
                   jax.ShapeDtypeStruct((s, b, hp), jnp.float32),
                   jax.ShapeDtypeStruct((s, b, hp), jnp.float32)],
        interpret=interpret,
        # Triton, not Mosaic GPU: the whole pool is one BlockSpec, gathered by page id inside the kernel
        compiler_params=pl_triton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        name="paged_mla_decode",
    )(*args)
    # the padded head rows are dropped before the merge reads the split partials
    return _merge_splits(o[:, :, :h], l[:, :, :h], m[:, :, :h]).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "pages_per_compute_block", "k_splits", "num_warps",
                                             "num_stages", "page_splits", "compute_dtype", "interpret",
                                             "out_dtype"))
def paged_gqa_decode(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                     lengths: jax.Array, k_scales: jax.Array | None = None, v_scales: jax.Array | None = None, *,
                     layer: int | jax.Array | None = None, softmax_scale: float,
                     pages_per_compute_block: int | None = None, k_splits: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, page_splits: int | None = None,
                     compute_dtype: jnp.dtype | None = None, interpret: bool = False,
                     out_dtype: jnp.dtype | None = None) -> jax.Array:
    """GQA decode attention over paged K/V.

    q: [batch, q_heads, head_dim] bf16|f32; k_pages, v_pages: [num_pages, page_size, kv_heads, head_dim]
    bf16|float8_e4m3fn (one layer); k_scales, v_scales: [num_pages, page_size, kv_heads] f32 for fp8, else None;
    or the whole pool (a leading layer axis on all four) with `layer`, and pages as bits, as in paged_mla_decode.
    block_tables: [batch, max_pages] int32; lengths: [batch] int32. q_heads must be a multiple of kv_heads.
    compute_dtype: dtype of the dot operands (default q.dtype). Tiling overrides (pages_per_compute_block,
    k_splits, num_warps, num_stages, page_splits): see choose_blocks.
    Returns [batch, q_heads, head_dim] in out_dtype (default q.dtype).
    """
    out_dtype = out_dtype or q.dtype
    q = q.astype(compute_dtype or q.dtype)
    b, hq, d = q.shape
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {k_pages.shape} {k_pages.dtype} != v_pages {v_pages.shape} {v_pages.dtype}")
    if (k_scales is None) != (v_scales is None):
        raise ValueError("pass both k_scales and v_scales or neither")
    v_pages = with_layer_axis(v_pages, 4, layer, ())[0]
    k_pages, (k_scales, v_scales), layer, value_dtype = with_layer_axis(k_pages, 4, layer, (k_scales, v_scales))
    n_layers, num_pages, page_size, hkv, d_k = k_pages.shape
    if d != d_k or hq % hkv:
        raise ValueError(f"q {q.shape}, k_pages {k_pages.shape}")
    fp8 = k_scales is not None
    group = hq // hkv
    # one program holds a kv head's whole query group (padded to block_h rows)
    blocks = choose_blocks(page_size, block_tables.shape[1], group, pages_per_compute_block=pages_per_compute_block,
                           k_splits=k_splits, num_warps=num_warps, num_stages=num_stages, page_splits=page_splits,
                           kv_widths=(d, d),
                           q_width=d, kv_dtype=value_dtype, q_dtype=q.dtype, n_scales=2 * int(fp8),
                           batch=b * hkv)
    bt, lens, pps = _prepare_tables(block_tables, lengths, page_size, blocks)
    gp = max(blocks.block_h, _next_pow2(group))
    qg = jnp.pad(q.reshape(b, hkv, group, d), ((0, 0), (0, 0), (0, gp - group), (0, 0)))
    s = blocks.k_splits
    kernel = functools.partial(_decode_kernel, mla=False, fp8=fp8, value_dim=d, page_size=page_size,
                               pages_per_compute_block=blocks.pages_per_compute_block,
                               page_splits=blocks.page_splits, softmax_scale=softmax_scale, value_dtype=value_dtype)
    pool = (n_layers, num_pages, page_size)
    kv_spec = pl.BlockSpec((*pool, None, d), lambda i, j, k: (0, 0, 0, j, 0))  # this kv head, all layers and pages
    in_specs = [
        pl.BlockSpec((None, pps), lambda i, j, k: (i, k)),
        pl.BlockSpec((None, 1), lambda i, j, k: (i, 0)),
        pl.BlockSpec((1,), lambda i, j, k: (0,)),  # layer
        pl.BlockSpec((None, None, gp, d), lambda i, j, k: (i, j, 0, 0)),
        kv_spec, kv_spec,
    ]
    args = [bt, lens, layer, qg, k_pages, v_pages]
    if fp8:
        sc_spec = pl.BlockSpec((*pool, None), lambda i, j, k: (0, 0, 0, j))
        in_specs += [sc_spec, sc_spec]
        args += [k_scales, v_scales]
    o, l, m = pl.pallas_call(
        kernel,
        grid=(b, hkv, s),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, gp, d), lambda i, j, k: (k, i, j, 0, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, j, k: (k, i, j, 0)),
                   pl.BlockSpec((None, None, None, gp), lambda i, j, k: (k, i, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((s, b, hkv, gp, d), jnp.float32),
                   jax.ShapeDtypeStruct((s, b, hkv, gp), jnp.float32),
                   jax.ShapeDtypeStruct((s, b, hkv, gp), jnp.float32)],
        interpret=interpret,
        compiler_params=pl_triton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        name="paged_gqa_decode",
    )(*args)
    out = _merge_splits(o, l, m)[:, :, :group]
    return out.reshape(b, hq, d).astype(out_dtype)
