"""Attention for the three families, as NNX modules over a dense (un-paged) context.

- `MLAttention`: DeepSeek-V3 / Kimi / GLM-5 multi-head latent attention, in the plain form (kv_b_proj expands the
  latent into per-head K and V) and the absorbed form (kv_b_proj folded into q and o: MQA over the cached latent
  row [c_kv | k_rope], which is what the paged decode kernel reads).
- `Indexer`: GLM-5's DSA lightning indexer (top-`index_topk` key selection per query).
- `GQAttention`: GLM-4.5 grouped-query attention with partial rotary, optional qk-norm and q/k/v bias.

Shapes: B batch, T query tokens, S key tokens, N heads, r kv_lora_rank, dr rope dims.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.layers import DENSE_FORMATS, LayerNorm, Linear, RMSNorm
from jaxserve.models.rope import apply_rope
from jaxserve.quant import ops
from jaxserve.quant.weight_format import WeightPlan
from jaxserve.sharding import Axes, Parallel

NEG_INF = float(jnp.finfo(jnp.float32).min)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the module default, not rms_norm_eps (as in HF)


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """scores [B, N, T, S] f32, mask [B, T, S] bool -> probabilities; fully masked rows give zeros, not NaN."""
    m = mask[:, None]
    s = jnp.where(m, scores, NEG_INF)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)) * m
    return p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)


def index_scores(q: jax.Array, w: jax.Array, k: jax.Array) -> jax.Array:
    """The DSA index score sum_h w_h * relu(q_h . k / sqrt(hd)).
    q [B, T, nh, hd] f32, w [B, T, nh] f32, k [B, S, hd] f32 -> [B, T, S] f32 (unmasked)."""
    s = jax.nn.relu(jnp.einsum("btnd,bsd->btns", q, k) * q.shape[-1] ** -0.5)
    return jnp.einsum("btn,btns->bts", w, s)


def once(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """The arrays as they are; on GPU each materialized once (an optimization barrier): XLA:GPU otherwise fuses a
    split-K GEMM's f32 partials' reduction into every consumer, each reading all the partials again."""
    return jax.lax.platform_dependent(*xs, cuda=lambda *a: jax.lax.optimization_barrier(a), default=lambda *a: a)


class Indexer(nnx.Module):
    """DSA lightning indexer: per query, the top-`index_topk` allowed keys by a ReLU multi-head score."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, path: str,
                 weights: WeightPlan = WeightPlan(), parallel: Parallel | None = None) -> None:
        self.cfg = cfg
        nh, hd = cfg.index_n_heads, cfg.index_head_dim

        def linear(name: str, din: int, dout: int, dtype: jnp.dtype) -> Linear:
            # replicated: the index score sums over the indexer's heads
            return Linear(din, dout, axes=(None, None), dtype=dtype, rngs=rngs,
                          fmt=weights.linear(f"{path}.{name}", din), parallel=parallel)

        self.wq_b = linear("wq_b", cfg.q_lora_rank, nh * hd, dtype)
        self.wk = linear("wk", cfg.hidden_size, hd, dtype)
        self.k_norm = LayerNorm(hd, 1e-6, dtype=dtype)
        self.weights_proj = linear("weights_proj", cfg.hidden_size, nh, jnp.float32)  # kept f32, as HF does

    def query(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, T, H], q_resid [B, T, q_lora] -> (queries [B, T, nh, hd] f32 (roped), head weights [B, T, nh] f32)."""
        cfg = self.cfg
        B, T, _ = x.shape
        nh, hd, dr = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        q = self.wq_b(q_resid).reshape(B, T, nh, hd)
        q = jnp.concatenate([apply_rope(q[..., :dr], cos, sin), q[..., dr:]], axis=-1)  # rope dims come first here
        w = self.weights_proj(x.astype(jnp.float32)) * nh**-0.5
        return q.astype(jnp.float32), w.astype(jnp.float32)

    def key(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [B, T, H] -> the per-token index key [B, T, hd] x.dtype (roped): what the indexer key cache stores."""
        dr = self.cfg.qk_rope_head_dim
        k = self.k_norm(self.wk(x))[:, :, None, :]
        return jnp.concatenate([apply_rope(k[..., :dr], cos, sin), k[..., dr:]], axis=-1)[:, :, 0]

    def scores(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        """x [B, T, H], q_resid [B, T, q_lora], mask [B, T, S] -> index scores [B, T, S] f32 (-inf where masked)."""
        q, w = self.query(x, q_resid, cos, sin)
        idx = index_scores(q, w, self.key(x, cos, sin).astype(jnp.float32))
        return jnp.where(mask, idx, -jnp.inf)

    def __call__(self, x: jax.Array, q_resid: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        """-> selected [B, T, S] bool: the top-`index_topk` keys of each query (all keys when S <= index_topk)."""
        idx = self.scores(x, q_resid, cos, sin, mask)
        S = idx.shape[-1]
        k = min(self.cfg.index_topk, S)
        if k == S:
            return jnp.ones(idx.shape, bool)
        _, top = jax.lax.top_k(idx, k)
        return jnp.any(jax.nn.one_hot(top, S, dtype=jnp.bool_), axis=-2)


class MLAttention(nnx.Module):
    """Multi-head latent attention. x [B, T, H] -> [B, T, H]."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, *, dtype: jnp.dtype, rngs: nnx.Rngs, path: str,
                 weights: WeightPlan = WeightPlan(), parallel: Parallel | None = None) -> None:
        self.cfg = cfg
        H, N = cfg.hidden_size, cfg.num_heads
        r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        bias = cfg.attention_bias

        def linear(name: str, din: int, dout: int, axes: Axes, bias: bool = False) -> Linear:
            return Linear(din, dout, axes=axes, dtype=dtype, rngs=rngs, bias=bias,
                          fmt=weights.linear(f"{path}.{name}", din), parallel=parallel)

        # the low-rank down projections are replicated (small; the latent is read by every head)
        if cfg.q_lora_rank:
            self.q_a = linear("q_a", H, cfg.q_lora_rank, (None, None), bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype=dtype)
            self.q_b = linear("q_b", cfg.q_lora_rank, N * cfg.qk_head_dim, (None, "heads"))
        else:
            self.q_proj = linear("q_proj", H, N * cfg.qk_head_dim, ("embed", "heads"))
        self.kv_a = linear("kv_a", H, r + dr, (None, None), bias)
        self.kv_a_norm = RMSNorm(r, LATENT_NORM_EPS, dtype=dtype)
        self.kv_b = linear("kv_b", r, N * (cfg.qk_nope_head_dim + cfg.v_head_dim), (None, "heads"))
        if self.kv_b.fmt in DENSE_FORMATS:  # held [N*(dn+dv), r] in memory on TPU (sharding.param_format)
            # the absorbed dots want r minor (W_UK's output dim; per-head 448 / 192-wide column blocks cut lane
            # tiles): XLA:TPU copied every layer's kv_b shard to that layout on each decode and prefill call
            self.kv_b.weight.set_metadata("tpu_major_to_minor", (1, 0))
        self.o = linear("o", N * cfg.v_head_dim, H, ("heads", "embed"), bias)
        self.indexer = Indexer(cfg, dtype=dtype, rngs=rngs, path=f"{path}.indexer", weights=weights,
                               parallel=parallel) if cfg.full_indexer(layer_idx) else None

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """-> q_nope [B,T,N,dn], q_rope [B,T,N,dr] (roped), latent [B,T,r+dr] ([c_kv normed | k_rope roped]),
        q_resid [B,T,q_lora] (the indexer's input; x itself when there is no q LoRA)."""
        cfg = self.cfg
        B, T, _ = x.shape
        dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            q_a, kv = once(self.q_a(x), self.kv_a(x))
            q_resid = self.q_a_norm(q_a)
            q = once(self.q_b(q_resid))[0]
        else:
            q_resid = x
            q, kv = once(self.q_proj(x), self.kv_a(x))
        q = q.reshape(B, T, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_rope = q[..., :dn], apply_rope(q[..., dn:], cos, sin)
        c_kv = self.kv_a_norm(kv[..., :r])
        k_rope = apply_rope(kv[..., None, r:], cos, sin)[:, :, 0]
        return q_nope, q_rope, jnp.concatenate([c_kv, k_rope], axis=-1), q_resid

    def kv_b_split(self) -> tuple[jax.Array, jax.Array]:
        """kv_b [r, N*(dn+dv)] -> W_UK [r, N, dn], W_UV [r, N, dv] (dequantized when kv_b is quantized)."""
        cfg = self.cfg
        w = self.kv_b.dense_weight().reshape(cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        return w[..., : cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:]

    def attend_plain(self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, mask: jax.Array) -> jax.Array:
        """Expanded form: latent [B,S,r+dr] -> per-head K, V. -> [B, T, N, dv]."""
        cfg = self.cfg
        B, S, _ = latent.shape
        r, dn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
        kv = self.kv_b(latent[..., :r]).reshape(B, S, cfg.num_heads, dn + cfg.v_head_dim)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        f32 = jnp.float32
        s = (jnp.einsum("btnd,bsnd->bnts", q_nope.astype(f32), k_nope.astype(f32))
             + jnp.einsum("btnd,bsd->bnts", q_rope.astype(f32), latent[..., r:].astype(f32)))
        p = masked_softmax(s * cfg.softmax_scale, mask)
        return jnp.einsum("bnts,bsnd->btnd", p, v.astype(f32)).astype(q_nope.dtype)

    def absorb_query(self, q_nope: jax.Array, q_rope: jax.Array) -> jax.Array:
        """q_nope [B,T,N,dn], q_rope [B,T,N,dr] -> absorbed query [B,T,N,r+dr] f32 (MQA against the latent row)."""
        w_uk, _ = self.kv_b_split()

        def narrow(qn: jax.Array, w: jax.Array) -> jax.Array:  # XLA:GPU: a bf16 GEMM, no f32 copy of the weight
            return jnp.einsum("btnd,rnd->btnr", qn, w.astype(qn.dtype), preferred_element_type=jnp.float32)

        def wide(qn: jax.Array, w: jax.Array) -> jax.Array:  # elsewhere f32, as served and tested on CPU
            return jnp.einsum("btnd,rnd->btnr", qn.astype(jnp.float32), w.astype(jnp.float32))

        q_lat = jax.lax.platform_dependent(q_nope, w_uk, cuda=narrow, default=wide)
        return jnp.concatenate([q_lat, q_rope.astype(jnp.float32)], axis=-1)

    def absorb_output(self, o_lat: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """o_lat [B,T,N,r] (softmax-weighted c_kv, f32) -> [B,T,N,dv] `dtype` through W_UV. On GPU o_lat is rounded
        to the weight's dtype, f32 accumulation (a bf16 GEMM: an f32 one widened the weight to f32 every step)."""
        _, w_uv = self.kv_b_split()
        b, t, n, r = o_lat.shape

        def up(o: jax.Array, w: jax.Array) -> jax.Array:  # [M, N, r] x [r, N, dv] -> [M, N, dv] f32
            return jnp.einsum("mnr,rnd->mnd", o, w, preferred_element_type=jnp.float32)

        def narrow(o_lat: jax.Array, w_uv: jax.Array) -> jax.Array:
            o = o_lat.reshape(b * t, n, r).astype(w_uv.dtype)
            # one row: per head a vector-matrix dot, which XLA:GPU would turn into an f32 [r, N, dv] product in HBM
            return (ops.one_row_as_two(up, o, w_uv) if b * t == 1 else up(o, w_uv)).reshape(b, t, n, -1)

        def wide(o_lat: jax.Array, w_uv: jax.Array) -> jax.Array:
            # elsewhere f32: rounding o_lat to bf16 made a 2-device DP layout's greedy tokens differ from one device's
            return jnp.einsum("btnr,rnd->btnd", o_lat.astype(jnp.float32), w_uv.astype(jnp.float32))

        return jax.lax.platform_dependent(o_lat, w_uv, cuda=narrow, default=wide).astype(dtype)

    def attend_absorbed(self, q_nope: jax.Array, q_rope: jax.Array, latent: jax.Array, mask: jax.Array) -> jax.Array:
        """Absorbed form over the latent [B,S,r+dr]: MQA with key = latent row, value = c_kv. -> [B, T, N, dv]."""
        r = self.cfg.kv_lora_rank
        q = self.absorb_query(q_nope, q_rope)
        lat = latent.astype(jnp.float32)
        s = jnp.einsum("btnc,bsc->bnts", q, lat)
        p = masked_softmax(s * self.cfg.softmax_scale, mask)
        o_lat = jnp.einsum("bnts,bsr->btnr", p, lat[..., :r])
        return self.absorb_output(o_lat, q_nope.dtype)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, *, absorbed: bool,
                 prev_selected: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """-> (out [B,T,H], DSA selection [B,T,S] bool or None). Dense context: keys are this call's tokens."""
        B, T, _ = x.shape
        q_nope, q_rope, latent, q_resid = self.project(x, cos, sin)
        selected = prev_selected
        if self.indexer is not None:
            selected = self.indexer(x, q_resid, cos, sin, mask)
        full_mask = mask if selected is None else mask & selected
        attend = self.attend_absorbed if absorbed else self.attend_plain
        o = attend(q_nope, q_rope, latent, full_mask)
        return self.o(o.reshape(B, T, -1)), selected


class GQAttention(nnx.Module):
    """Grouped-query attention with partial half-split rotary. x [B, T, H] -> [B, T, H]."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, path: str,
                 weights: WeightPlan = WeightPlan(), parallel: Parallel | None = None) -> None:
        self.cfg = cfg
        H, N, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias

        def linear(name: str, din: int, dout: int, axes: Axes, bias: bool) -> Linear:
            return Linear(din, dout, axes=axes, dtype=dtype, rngs=rngs, bias=bias,
                          fmt=weights.linear(f"{path}.{name}", din), parallel=parallel)

        self.q = linear("q", H, N * D, ("embed", "heads"), bias)
        self.k = linear("k", H, K * D, ("embed", "kv_heads"), bias)
        self.v = linear("v", H, K * D, ("embed", "kv_heads"), bias)
        self.o = linear("o", N * D, H, ("heads", "embed"), False)  # o_proj never has a bias in GLM-4.5
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """-> q [B,T,N,D], k [B,T,K,D] (both roped on the first rope_dim dims), v [B,T,K,D]."""
        cfg = self.cfg
        B, T, _ = x.shape
        D, rd = cfg.head_dim, cfg.rope_dim
        q = self.q(x).reshape(B, T, cfg.num_heads, D)
        k = self.k(x).reshape(B, T, cfg.num_kv_heads, D)
        v = self.v(x).reshape(B, T, cfg.num_kv_heads, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, before RoPE (as HF)
        q = jnp.concatenate([apply_rope(q[..., :rd], cos, sin), q[..., rd:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :rd], cos, sin), k[..., rd:]], axis=-1)
        return q, k, v

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
        """q [B,T,N,D], k, v [B,S,K,D] -> [B,T,N,D]."""
        cfg = self.cfg
        B, T, N, D = q.shape
        G = N // cfg.num_kv_heads
        qg = q.reshape(B, T, cfg.num_kv_heads, G, D).astype(jnp.float32)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)).reshape(B, N, T, -1)
        p = masked_softmax(s * cfg.softmax_scale, mask).reshape(B, cfg.num_kv_heads, G, T, -1)
        return jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32)).reshape(B, T, N, D).astype(q.dtype)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array, *, absorbed: bool,
                 prev_selected: jax.Array | None) -> tuple[jax.Array, None]:
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        return self.o(self.attend(q, k, v, mask).reshape(B, T, -1)), None
