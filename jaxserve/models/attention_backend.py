"""The attention backend: which implementation runs paged attention over the pool, parsed once from the engine's
`attention` string, and the one dispatch of decode and prefill attention through it, per pool kind (MLA latent
pages, GQA K/V pages; GLM-5 DSA layers read MLA pages and use the MLA decode while their table is dense).

Names: "xla" (the length-bounded page-block loops, `paged_attention_xla` and `prefill_attention_xla`),
"pallas" (the GPU-shaped Triton kernels), "pallas_tpu" (the TPU-shaped Mosaic kernels), and either Pallas name
+ "_interpret" (the same kernels run on CPU).

"xla" and every Pallas kernel (GPU / Triton and TPU / Mosaic, decode and prefill, MLA and GQA) read the whole
pool's bit patterns (all layers; the layer picked inside the gathers, or handed to the kernel, which views the bits
as values once loaded): a per-layer slice handed to a kernel call is materialized by XLA (302 MB per layer on TPU,
946 MB on H200 at Kimi K2.6's pools; GLM-4.5's K and V per layer on v5p; the MLA prefill's value view of a layer on
v6e). On a mesh each runs per shard (`sharded.attention`): heads split under TP attention, rows and pages under DP
attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import jax
import jax.numpy as jnp

from jaxserve.cache import KVLayout, KVPages
from jaxserve.errors import ConfigError
from jaxserve.models import paged_attention_xla, prefill_attention_xla, sharded
from jaxserve.sharding import POOL_AXES, Parallel
from pallas_kernels.paged_attention import paged_gqa_decode, paged_mla_decode
from pallas_kernels.paged_attention_tpu import paged_gqa_decode_tpu, paged_mla_decode_tpu
from pallas_kernels.paged_prefill import paged_prefill_gqa, paged_prefill_mla

ATTENTION_NAMES = ("xla", "pallas", "pallas_interpret", "pallas_tpu", "pallas_tpu_interpret")
Implementation = Literal["xla", "pallas", "pallas_tpu"]
# the pool arrays of each kind, in kernel order (`KVPages.layer`'s order)
_POOL_FIELDS = {"mla": ("latent", "latent_scale"), "gqa": ("k", "v", "k_scale", "v_scale")}


@dataclass(frozen=True)
class AttentionBackend:
    """implementation: "xla" | "pallas" (Triton tiling) | "pallas_tpu" (Mosaic tiling); interpret: run the
    Pallas kernels on CPU (never set for "xla")."""

    implementation: Implementation = "xla"
    interpret: bool = False

    def __post_init__(self) -> None:
        name = self.implementation + ("_interpret" if self.interpret else "")
        if name not in ATTENTION_NAMES:
            raise ConfigError(f"attention must be one of {', '.join(ATTENTION_NAMES)}", value=name, param="attention")

    @classmethod
    def parse(cls, name: str) -> AttentionBackend:
        """An `ATTENTION_NAMES` entry -> its backend; anything else is a ConfigError."""
        return cls(name.removesuffix("_interpret"), name.endswith("_interpret"))

    @property
    def tiling(self) -> Literal["gpu", "tpu"]:
        """The Pallas tiling this backend selects (also for the quantized matmul kernels): "tpu" (Mosaic) for
        pallas_tpu, else "gpu" (Triton)."""
        return "tpu" if self.implementation == "pallas_tpu" else "gpu"

    def decode(self, par: Parallel | None, q: jax.Array, pages: KVPages, layer: int, block_tables: jax.Array,
               lengths: jax.Array, *, softmax_scale: float) -> jax.Array:
        """One query token per row over layer `layer` of the pool. block_tables [B, M] int32, lengths [B] int32.
        MLA: q [B, N, r + dr] f32 (absorbed) -> [B, N, r] f32; GQA: q [B, Hq, D] -> [B, Hq, D] f32."""
        lay = pages.layout

        def kernel(q: jax.Array, pools: tuple, tables: tuple) -> jax.Array:
            return self._decode_kernel(q, pools, tables, lay, layer, softmax_scale)

        whole = self.implementation in ("pallas", "pallas_tpu") or lay.kind == "mla"
        return self._per_shard(par, kernel, q, pages, layer, (block_tables, lengths), ("batch", "heads", None),
                               whole=whole)

    def prefill(self, par: Parallel | None, q: jax.Array, pages: KVPages, layer: int, tables: tuple, *,
                softmax_scale: float, act_dtype: jnp.dtype) -> jax.Array:
        """A chunk of T query tokens per row over layer `layer` of the pool (the chunk's KV already written).
        tables: (block_tables [B, M] int32, positions [B, T] int32, ctx_lens [B] int32). "xla" takes
        `prefill_dot_dtype(act_dtype, pool values)` dot operands. MLA: q [B, T, N, r + dr] f32 (absorbed)
        -> [B, T, N, r] f32; GQA: q [B, T, Hq, D] -> [B, T, Hq, D] f32."""
        lay = pages.layout
        dot_dtype = prefill_attention_xla.prefill_dot_dtype(act_dtype, lay.jnp_dtype)

        def kernel(q: jax.Array, pools: tuple, tables: tuple) -> jax.Array:
            return self._prefill_kernel(q, pools, tables, lay, layer, softmax_scale, dot_dtype)

        # every Pallas prefill reads the whole pool: a layer's slice (or its value view) was copied per layer
        whole = self.implementation in ("pallas", "pallas_tpu")
        return self._per_shard(par, kernel, q, pages, layer, tables, ("batch", None, "heads", None), whole=whole)

    def _per_shard(self, par: Parallel | None, kernel: Callable, q: jax.Array, pages: KVPages, layer: int,
                   tables: tuple, q_axes: tuple, whole: bool = False) -> jax.Array:
        """kernel(q, pools, tables) on this backend's pools: the whole pool's bits ("xla", or `whole`) or the
        layer's value views; per shard on a mesh."""
        fields = _POOL_FIELDS[pages.layout.kind]
        xla = self.implementation == "xla" or whole
        pools = tuple(getattr(pages, f) for f in fields) if xla else pages.layer(layer)
        if par is None:
            return kernel(q, pools, tables)
        axes = tuple(POOL_AXES[f] for f in fields)
        pool_axes = axes if xla else tuple(a[1:] for a in axes)  # the kernels get one layer: no leading layer axis
        return sharded.attention(par, kernel, q, pools, tables, pool_axes=pool_axes, q_axes=q_axes)

    def _decode_kernel(self, q: jax.Array, pools: tuple, tables: tuple, lay: KVLayout, layer: int,
                       softmax_scale: float) -> jax.Array:
        bt, lengths = tables
        if lay.kind == "mla":
            (lat, scale), rank = pools, lay.kv_lora_rank
            if self.implementation == "xla":
                return paged_attention_xla.mla_decode(q, lat, scale, bt, lengths, layer=layer, layout=lay,
                                                      kv_lora_rank=rank, softmax_scale=softmax_scale)
            if self.implementation == "pallas_tpu":  # the whole pool's bits (see the module docstring)
                return paged_mla_decode_tpu(q, lat, bt, lengths, scale, layer=layer, kv_lora_rank=rank,
                                            softmax_scale=softmax_scale, interpret=self.interpret)
            return paged_mla_decode(q, lat, bt, lengths, scale, layer=layer, kv_lora_rank=rank,
                                    softmax_scale=softmax_scale, interpret=self.interpret, out_dtype=jnp.float32)
        kp, vp, ks, vs = pools
        if self.implementation == "xla":
            return paged_attention_xla.gqa_decode(q, kp, vp, ks, vs, bt, lengths, layer=layer, layout=lay,
                                                  softmax_scale=softmax_scale)
        if self.implementation == "pallas_tpu":  # the whole pool's bits, as the MLA kernel
            return paged_gqa_decode_tpu(q, kp, vp, bt, lengths, ks, vs, layer=layer, softmax_scale=softmax_scale,
                                        interpret=self.interpret, out_dtype=jnp.float32)
        return paged_gqa_decode(q, kp, vp, bt, lengths, ks, vs, layer=layer, softmax_scale=softmax_scale,
                                interpret=self.interpret, out_dtype=jnp.float32)

    def _prefill_kernel(self, q: jax.Array, pools: tuple, tables: tuple, lay: KVLayout, layer: int,
                        softmax_scale: float, dot_dtype: jnp.dtype) -> jax.Array:
        bt, positions, ctx_lens = tables
        xla = self.implementation == "xla"
        if lay.kind == "mla":
            (lat, scale), rank = pools, lay.kv_lora_rank
            if xla:
                return prefill_attention_xla.prefill_mla_blockwise(
                    q, lat, bt, positions, ctx_lens, scale, kv_lora_rank=rank, softmax_scale=softmax_scale,
                    value_dtype=lay.jnp_dtype, layer=layer, dot_dtype=dot_dtype)
            return paged_prefill_mla(q, lat, bt, positions, ctx_lens, scale, layer=layer,  # the whole pool's bits
                                     kv_lora_rank=rank, softmax_scale=softmax_scale, backend=self.tiling,
                                     interpret=self.interpret)
        kp, vp, ks, vs = pools
        if xla:
            return prefill_attention_xla.prefill_gqa_blockwise(
                q, kp, vp, bt, positions, ctx_lens, ks, vs, softmax_scale=softmax_scale, value_dtype=lay.jnp_dtype,
                layer=layer, dot_dtype=dot_dtype)
        return paged_prefill_gqa(q, kp, vp, bt, positions, ctx_lens, ks, vs, layer=layer,  # the whole pool's bits
                                 softmax_scale=softmax_scale, backend=self.tiling, interpret=self.interpret)
