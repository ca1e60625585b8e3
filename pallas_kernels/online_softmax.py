"""The online softmax the TPU attention kernels share (paged decode, paged prefill, sparse MLA decode).

Flash attention's running state lives in VMEM scratch: m [rows, 1] f32 (running max of the scaled logits), l
[rows, 1] f32 (running denominator), acc [rows, Dv] f32 (running numerator). A kernel folds one block of logits at a
time: `fold_logits` rescales m and l and returns the block's unnormalized probabilities with the factor that rescales
acc, `fold_values` adds their product with the block's values, `write_out` divides once at the end. Masked logits are
MASK_VALUE (not -inf: exp(MASK_VALUE - m) underflows to exactly 0 without an inf - inf NaN).
"""

import jax
import jax.numpy as jnp
from jax import lax

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def dot_precision(dtype) -> lax.Precision | None:
    """Mosaic refuses an fp32-precision contraction of bf16 operands (jax_default_matmul_precision="highest")."""
    return None if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def reset(m_sc, l_sc, acc_sc) -> None:
    """Empty state: m = MASK_VALUE, l = 0, acc = 0 (scratch refs [rows, 1], [rows, 1], [rows, Dv] f32)."""
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def fold_logits(m_sc, l_sc, logits: jax.Array, keep: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Fold a block's scaled, masked logits [rows, bk] f32 into m and l.

    -> (p [rows, bk] f32, the block's unnormalized probabilities; correction [rows, 1] f32, acc's rescale factor).
    keep [rows, bk] bool (optional) zeroes p where False: needed where a row may have seen no key yet (m is still
    MASK_VALUE and exp(0) = 1 would count); without it masked entries rely on underflowing to exactly 0.
    """
    m_prev, l_prev = m_sc[...], l_sc[...]
    m_next = jnp.maximum(m_prev, logits.max(axis=-1, keepdims=True))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.exp(logits - m_next)
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    l_sc[...] = correction * l_prev + p.sum(axis=-1, keepdims=True)
    m_sc[...] = m_next
    return p, correction


def fold_values(acc_sc, p: jax.Array, correction: jax.Array, v: jax.Array) -> None:
    """acc = correction * acc + p @ v: p [rows, bk] f32 (V-side dequant already applied), v [bk, Dv] (p is cast to
    v's dtype for the MXU; f32 accumulation)."""
    acc_sc[...] = correction * acc_sc[...] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                                                     precision=dot_precision(v.dtype))


def write_out(o_ref, l_sc, acc_sc) -> None:
    """o = acc / l, in o_ref's dtype; a row that saw no key (l == 0: empty sequence, padding) gets 0, not 0 / 0."""
    l = l_sc[...]
    o_ref[...] = jnp.where(l > 0, acc_sc[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)
