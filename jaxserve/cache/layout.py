"""Static shape of a paged KV pool (`KVLayout`): its kind, value and storage dtypes, and bytes per token.

Two kinds:
  * "mla": one latent row per token and layer, `latent_dim = kv_lora_rank + qk_rope_head_dim` (Kimi: 512 + 64).
    The attention "value" is the first `kv_lora_rank` columns of the row.
  * "gqa": K and V, each `[kv_heads, head_dim]` per token and layer (GLM-4.5: 8 x 128).

Each pool has a value dtype (`jnp_dtype`: float8_e4m3fn, bfloat16 or float32) and stores its values as their bit
patterns (`storage_dtype`: uint8, uint16 or uint32; see `jaxserve.cache.pool` for why). FP8 pools add one float32
scale per token (MLA) or per token and kv head (GQA).

DSA indexer keys (GLM-5.x, optional, MLA only): one `index_head_dim` key per token for each layer that runs its
own indexer ("full" layers; IndexShare layers reuse another layer's selection and store nothing), in the same pages
and slots as the latent rows, so page ids, tags, the prefix cache and the hand-off cover them unchanged. FP8 (one
f32 scale per key, as the reference design stores them) when the pool is FP8, or BF16 (`index_dtype="bf16"`).

Slots: a token's slot is `page * page_size + offset`. Page 0 (`NULL_PAGE`) is reserved by the allocator: block
tables pad with it so gathers of padding entries read a valid, never-owned page (masked by lengths).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import jax.numpy as jnp

from jaxserve.errors import ConfigError
from jaxserve.format_names import KV_DTYPES, KVDtype, canonical_format

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = jnp.float8_e4m3fn
NULL_PAGE = 0  # reserved padding page (see PageAllocator)

KVKind = Literal["mla", "gqa"]


@dataclass(frozen=True)
class KVLayout:
    """Static shape of a KV page pool. MLA fields are 0 for GQA and vice versa."""

    kind: KVKind
    num_layers: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    page_size: int = 16
    dtype: KVDtype = "bf16"
    index_layers: int = 0  # layers with a DSA indexer key cache (0: none)
    index_head_dim: int = 0
    index_dtype: KVDtype | None = None  # indexer keys' dtype; None: the pool's dtype

    def __post_init__(self) -> None:
        if self.kind not in ("mla", "gqa"):
            raise ConfigError(f"KV layout kind must be 'mla' or 'gqa', got {self.kind!r}", value=self.kind, param="kind")
        # accept the dtype names users type ("bfloat16", "float8_e4m3fn", ...) for the pool's formats
        object.__setattr__(self, "dtype", canonical_format(self.dtype))
        object.__setattr__(self, "index_dtype", canonical_format(self.index_dtype))
        if self.dtype not in KV_DTYPES:
            raise ConfigError(f"KV dtype must be 'bf16', 'fp8' or 'f32', got {self.dtype!r}", value=self.dtype,
                              param="dtype")
        for name in ("num_layers", "page_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive", value=getattr(self, name), param=name)
        if self.kind == "mla" and (self.kv_lora_rank <= 0 or self.qk_rope_head_dim < 0):
            raise ConfigError("MLA layout needs kv_lora_rank > 0", value=self.kv_lora_rank, param="kv_lora_rank")
        if self.kind == "gqa" and (self.kv_heads <= 0 or self.head_dim <= 0):
            raise ConfigError("GQA layout needs kv_heads > 0 and head_dim > 0", value=(self.kv_heads, self.head_dim),
                              param="kv_heads")
        if self.index_layers and (self.kind != "mla" or self.index_head_dim <= 0):
            raise ConfigError("an indexer key cache needs an MLA layout and index_head_dim > 0",
                              value=(self.kind, self.index_head_dim), param="index_head_dim")
        if self.index_dtype is not None and self.index_dtype not in KV_DTYPES:
            raise ConfigError(f"index dtype must be 'bf16', 'fp8' or 'f32', got {self.index_dtype!r}",
                              value=self.index_dtype, param="index_dtype")

    @classmethod
    def mla(cls, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, page_size: int = 16,
            dtype: KVDtype = "bf16", index_layers: int = 0, index_head_dim: int = 0,
            index_dtype: KVDtype | None = None) -> KVLayout:
        return cls("mla", num_layers, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                   page_size=page_size, dtype=dtype, index_layers=index_layers, index_head_dim=index_head_dim,
                   index_dtype=index_dtype)

    @classmethod
    def gqa(cls, num_layers: int, kv_heads: int, head_dim: int, page_size: int = 16,
            dtype: KVDtype = "bf16") -> KVLayout:
        return cls("gqa", num_layers, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype)

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def jnp_dtype(self) -> jnp.dtype:
        """The value dtype (float8_e4m3fn, bfloat16 or float32) that `KVPages.layer` and gathers present."""
        return jnp.dtype({"fp8": FP8_DTYPE, "bf16": jnp.bfloat16, "f32": jnp.float32}[self.dtype])

    @property
    def storage_dtype(self) -> jnp.dtype:
        """The dtype the pool arrays are stored in: the value dtype's bit pattern (uint8 / uint16 / uint32)."""
        return jnp.dtype({"fp8": jnp.uint8, "bf16": jnp.uint16, "f32": jnp.uint32}[self.dtype])

    def with_dtype(self, dtype: KVDtype) -> KVLayout:
        """The same layout in another pool dtype (indexer keys follow it unless `index_dtype` is set)."""
        return replace(self, dtype=dtype)

    @property
    def index_layout(self) -> KVLayout:
        """The indexer keys' own dtype view: `index_layout.jnp_dtype` / `.storage_dtype` / `.dtype` for them."""
        return replace(self, dtype=self.index_dtype or self.dtype, index_dtype=None)

    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, FP8 scales (f32) and DSA indexer keys included."""
        elem = self.jnp_dtype.itemsize
        scale = 4 if self.dtype == "fp8" else 0
        if self.kind == "mla":
            per_layer = self.latent_dim * elem + scale
        else:
            per_layer = 2 * self.kv_heads * (self.head_dim * elem + scale)
        return self.num_layers * per_layer + self.index_bytes_per_token()

    def index_bytes_per_token(self) -> int:
        """Bytes of one token's DSA indexer keys across the indexer layers (0 without an indexer cache)."""
        il = self.index_layout
        return self.index_layers * (self.index_head_dim * il.jnp_dtype.itemsize + (4 if il.dtype == "fp8" else 0))

    def tokens_per_gib(self) -> float:
        return float(2**30) / self.bytes_per_token()
