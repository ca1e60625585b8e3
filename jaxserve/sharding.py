"""Where every array lives: logical axes mapped to a 2-D device mesh ("dp", "tp"), by one set of rules.

Every parameter declares its logical axes where the model creates it (`nnx.Param(value, axes=(...))`);
`ShardingRules` maps each logical axis to mesh axes (or None: replicated). A dim whose size does not divide by its
mesh axes is an error naming the parameter and dim, never a silent replication. A parameter declared without axes
is an error too.

Logical axes: batch (decode rows / prefill rows), heads (attention query heads), kv_heads (GQA K/V heads), embed
(the hidden size), ffn (dense and shared-expert intermediate), experts (routed expert index), expert_ffn
(routed expert intermediate), vocab, pages (the KV page pool's page axis).

Presets:
  tensor_parallel  heads, kv_heads, ffn, expert_ffn and vocab over "tp"; the MLA latent pool replicated. On a TPU
                   mesh, routed experts whose FFN shard would be narrower than a 128-lane tile split whole instead.
  expert_parallel  as tensor_parallel, but experts over "tp" whole (no FFN split).
  dp_attention     attention data-parallel: rows and the page pool split over "dp" (each device holds its own
                   requests' latent pages), attention weights replicated; experts over ("dp", "tp").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.errors import ConfigError

MeshAxes = str | tuple[str, ...] | None
Axes = tuple[str | None, ...]
MESH_AXES = ("dp", "tp")


class ShardingError(ConfigError):
    """A parameter or activation cannot be laid out on the mesh as the rules say."""


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axes. None replicates the dim."""

    batch: MeshAxes = None
    heads: MeshAxes = "tp"
    kv_heads: MeshAxes = "tp"
    embed: MeshAxes = None
    ffn: MeshAxes = "tp"
    experts: MeshAxes = None
    expert_ffn: MeshAxes = "tp"
    vocab: MeshAxes = "tp"
    pages: MeshAxes = None

    @classmethod
    def tensor_parallel(cls) -> ShardingRules:
        return cls()

    @classmethod
    def expert_parallel(cls) -> ShardingRules:
        return cls(experts="tp", expert_ffn=None)

    @classmethod
    def dp_attention(cls) -> ShardingRules:
        return cls(batch="dp", heads=None, kv_heads=None, pages="dp", experts=("dp", "tp"), expert_ffn=None)

    @classmethod
    def preset(cls, name: str) -> ShardingRules:
        presets = {"tp": cls.tensor_parallel, "ep": cls.expert_parallel, "dp_attention": cls.dp_attention}
        if name not in presets:
            raise ShardingError(f"unknown sharding preset {name!r}; known: {sorted(presets)}", value=name,
                                param="sharding")
        return presets[name]()

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes a logical axis maps to, as a tuple (empty: replicated)."""
        if logical is None:
            return ()
        if logical not in {f.name for f in fields(self)}:
            raise ShardingError(f"unknown logical axis {logical!r}", value=logical, param="axes")
        m = getattr(self, logical)
        return () if m is None else (m,) if isinstance(m, str) else tuple(m)

    def spec(self, axes: Axes) -> P:
        """PartitionSpec of an array with logical `axes`; two dims on one mesh axis is an error."""
        used: dict[str, str] = {}
        out = []
        for logical in axes:
            mesh_axes = self.mesh_axes(logical)
            for m in mesh_axes:
                if m in used:
                    raise ShardingError(f"logical axes {used[m]!r} and {logical!r} both map to mesh axis {m!r}",
                                        value=axes, param="axes")
                used[m] = str(logical)
            out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        return P(*out)


@dataclass(frozen=True)
class Parallel:
    """A mesh and the rules over it: what a sharded model carries (static, hashable) to build its shard_maps."""

    mesh: Mesh
    rules: ShardingRules

    def size(self, logical: str | None) -> int:
        """How many shards a logical axis is split into."""
        return math.prod(self.mesh.shape[m] for m in self.rules.mesh_axes(logical))

    def axis(self, logical: str | None) -> MeshAxes:
        """The mesh axis name(s) for collectives over a logical axis (None when it is not split)."""
        mesh_axes = tuple(m for m in self.rules.mesh_axes(logical) if self.mesh.shape[m] > 1)
        return None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes

    def spec(self, axes: Axes) -> P:
        """PartitionSpec with mesh axes of size 1 dropped (so replicated and size-1 splits compare equal)."""
        return P(*(self._trim(a) for a in self.rules.spec(axes)))

    def _trim(self, entry: MeshAxes) -> MeshAxes:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        names = tuple(m for m in names if self.mesh.shape[m] > 1)
        return None if not names else names[0] if len(names) == 1 else names

    def sharding(self, axes: Axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def shard_map(self, fn: Callable, in_specs: object, out_specs: object) -> Callable:
        """`fn` run per device with explicit specs over this mesh."""
        # check_vma off: Pallas calls inside carry no varying-manual-axes annotations
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def check(self, name: str, shape: Sequence[int], axes: Axes) -> None:
        """Raise ShardingError when a split dim does not divide by its shard count."""
        if len(axes) != len(shape):
            raise ShardingError(f"{name}: {len(axes)} logical axes {axes} for shape {tuple(shape)}", value=axes,
                                param=name)
        for dim, (n, logical) in enumerate(zip(shape, axes)):
            k = self.size(logical)
            if n % k:
                raise ShardingError(f"{name}: dim {dim} ({logical}) has size {n}, which does not divide into {k} "
                                    f"shards over mesh axes {self.rules.mesh_axes(logical)}", value=n, param=name)


def make_mesh(devices: Sequence[jax.Device], dp: int = 1) -> Mesh:
    """A ("dp", "tp") mesh over `devices`: dp rows of len(devices) // dp devices."""
    n = len(devices)
    if dp < 1 or n % dp:
        raise ShardingError(f"dp={dp} does not divide {n} devices", value=dp, param="dp")
    return Mesh(np.array(devices).reshape(dp, n // dp), MESH_AXES)


# ---- parameters -----------------------------------------------------------------------------------------------
# Each parameter declares its logical axes where it is created (`nnx.Param(value, axes=(...))`); quantized weights
# and their scales keep the dense weight's axes: INT4 [K//2, N] + scale [K//g, N], FP8 [K, N] + scale
# [K/128, N/128], and also carry their block grid (`blocks=Blocks(...)`). Per split dim, with shard size
# s = n / shards and t stored weight elements per scale entry:
#   s % t == 0   weight and scale split alike (each shard holds whole blocks);
#   t % s == 0   weight split, scale kept whole on that dim (each shard lies inside one block: the device slices its
#                block out with `local_scale`; costs the scale's other shards' bytes, e.g. GLM-5.2's expert scales);
#   otherwise    weight and scale both kept whole on that dim (a shard would start inside a block, which no kernel
#                indexes), e.g. Kimi K2.6's dense MLP (18432 = 144 blocks) over 32 devices.
@dataclass(frozen=True)
class Blocks:
    """A quantized weight's block grid: its stored shape, the stored elements per scale entry along each dim, and
    whether the parameter carrying this is the scale (else the weight)."""

    weight_shape: tuple[int, ...]
    tile: tuple[int, ...]
    scale: bool = False


def _dim_split(n: int, shards: int, tile: int) -> str:
    """How a weight dim of n elements (t = tile per scale entry) splits: "both", "weight" or "neither"."""
    s = n // shards
    if shards == 1 or tile == 1 or s % tile == 0:
        return "both"
    return "weight" if s and tile % s == 0 else "neither"


def param_axes(name: str, var: nnx.Variable) -> Axes:
    """The logical axes `var` (the parameter at path `name`) was declared with."""
    axes = var.get_metadata().get("axes")
    if axes is None:
        raise ShardingError(f"parameter {name} has no declared logical axes (create it as nnx.Param(..., axes=))",
                            value=name, param="path")
    return axes


LANES = 128  # the minor dim of a TPU tile: a narrower shard of a weight's minor dim is padded or relaid out


def _narrow_experts(parallel: Parallel, axes: Axes, experts: tuple[int, int] | None) -> Axes:
    """A routed expert weight's axes on a TPU mesh where its FFN (`experts`: (count, FFN width), the parameter's
    `experts` metadata) would split into shards that are not whole lane tiles (narrower than 128, or not a multiple
    of it) and the count divides by expert_ffn's shards: whole experts split over expert_ffn's mesh axes instead
    (as under EP; the "expert_ffn" name then stands on the experts dim). XLA:TPU relaid out every 64-wide shard of
    Kimi K2.6's experts at 32 chips before the kernel (120 copies of 88 MB per decode step), and every 192-wide
    shard of GLM-4.5's at 8 chips. Elsewhere: `axes` unchanged."""
    k = parallel.size("expert_ffn")
    if (experts is None or k == 1 or (experts[1] // k) % LANES == 0 or experts[0] % k
            or parallel.size("experts") > 1 or parallel.mesh.devices.flat[0].platform != "tpu"):
        return axes
    return tuple("expert_ffn" if a == "experts" else None if a == "expert_ffn" else a for a in axes)


def split_axes(parallel: Parallel, name: str, var: nnx.Variable) -> Axes:
    """The logical axes `var` is actually split by: its declared axes (a narrow routed expert's swapped for whole
    experts, `_narrow_experts`), with a quantized pair's dims that the block rule above keeps whole set to None."""
    meta = var.get_metadata()
    axes = _narrow_experts(parallel, param_axes(name, var), meta.get("experts"))
    blocks: Blocks | None = meta.get("blocks")
    if blocks is None:
        return axes
    out = []
    for logical, n, t in zip(axes, blocks.weight_shape, blocks.tile):
        how = _dim_split(n, parallel.size(logical), t)
        out.append(logical if how == "both" or (how == "weight" and not blocks.scale) else None)
    return tuple(out)


def local_scale(parallel: Parallel | None, scale: nnx.Variable, weight_shape: Sequence[int]) -> jax.Array:
    """The scale entries for a weight of `weight_shape` (this device's shard inside a shard_map, or the whole
    weight): where the scale is kept whole while the weight is split, this device's one block along that dim."""
    value = scale.get_value()
    blocks: Blocks | None = scale.get_metadata().get("blocks")
    if parallel is None or blocks is None:
        return value
    for d, (logical, n, t) in enumerate(zip(param_axes("scale", scale), blocks.weight_shape, blocks.tile)):
        if weight_shape[d] < n and _dim_split(n, parallel.size(logical), t) == "weight":
            first = jax.lax.axis_index(parallel.axis(logical)) * weight_shape[d] // t
            value = jax.lax.dynamic_slice_in_dim(value, first, 1, axis=d)
    return value


def param_spec(parallel: Parallel, name: str, var: nnx.Variable) -> P:
    """PartitionSpec of one parameter; raises ShardingError when a split dim does not divide."""
    blocks: Blocks | None = var.get_metadata().get("blocks")
    shape = var.get_value().shape
    parallel.check(name, shape if blocks is None else blocks.weight_shape, param_axes(name, var))  # as declared
    split = split_axes(parallel, name, var)
    parallel.check(name, shape, split)
    return parallel.spec(split)


def param_sharding(parallel: Parallel, name: str, var: nnx.Variable) -> NamedSharding:
    """NamedSharding of one parameter; raises ShardingError when a split dim does not divide."""
    return NamedSharding(parallel.mesh, param_spec(parallel, name, var))


def param_format(parallel: Parallel, name: str, var: nnx.Variable) -> NamedSharding | Format:
    """`param_sharding`, and on a TPU mesh a parameter declared with a `tpu_major_to_minor` dim order (its
    metadata) held in that order: the layout XLA:TPU's dots want it in, which the program would otherwise copy it
    to on every call (an argument's layout is fixed; the weight is placed in it once)."""
    sharding = param_sharding(parallel, name, var)
    order = var.get_metadata().get("tpu_major_to_minor")
    if order is None or parallel.mesh.devices.flat[0].platform != "tpu":
        return sharding
    return Format(Layout(major_to_minor=tuple(order)), sharding)


def _map_params(fn: Callable[[str, nnx.Variable], object], state: nnx.State) -> nnx.State:
    def one(path: tuple, var: nnx.Variable) -> nnx.Variable:
        return var.replace(fn(".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), var))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(parallel: Parallel, state: nnx.State) -> nnx.State:
    """The NamedSharding of every parameter of `state` (a State-shaped tree); raises ShardingError on a dim that
    does not divide."""
    return _map_params(lambda name, var: param_sharding(parallel, name, var), state)


def state_formats(parallel: Parallel, state: nnx.State) -> nnx.State:
    """`state_shardings`, with the parameters a TPU holds in their own dim order as Formats (`param_format`): what
    a program's weights are placed with and compiled for."""
    return _map_params(lambda name, var: param_format(parallel, name, var), state)


def state_specs(parallel: Parallel, state: nnx.State) -> nnx.State:
    """The PartitionSpec of every parameter of `state` (a module's own state: names relative to it)."""
    return _map_params(lambda name, var: parallel.spec(split_axes(parallel, name, var)), state)


def check_model(parallel: Parallel, heads: int, kv_heads: int, experts: int) -> None:
    """Head and expert counts must divide by their shard counts (a flattened [N * head_dim] weight dim divides by
    the mesh even when N does not, which would split a head across devices)."""
    for name, n, logical in (("num_heads", heads, "heads"), ("num_kv_heads", kv_heads, "kv_heads"),
                             ("n_routed_experts", experts, "experts")):
        k = parallel.size(logical)
        if n and n % k:
            raise ShardingError(f"{name}={n} does not divide into {k} shards ({logical} over mesh axes "
                                f"{parallel.rules.mesh_axes(logical)})", value=n, param=name)


# ---- the KV page pool ------------------------------------------------------------------------------------------
# Pools are [layers, pages, page_size, ...]: the MLA latent row is read by every head (replicated under TP
# attention, split by pages under DP attention); GQA K/V split by kv head.
POOL_AXES: dict[str, Axes] = {
    "latent": (None, "pages", None, None),
    "latent_scale": (None, "pages", None),
    "k": (None, "pages", None, "kv_heads", None),
    "v": (None, "pages", None, "kv_heads", None),
    "k_scale": (None, "pages", None, "kv_heads"),
    "v_scale": (None, "pages", None, "kv_heads"),
    "tags": ("pages",),  # per-page integrity tags, split like the page axis
    # DSA indexer keys live beside the latent rows and are read the same way (by every head of the indexer)
    "index_k": (None, "pages", None, None),
    "index_k_scale": (None, "pages", None),
}


def pool_sharding(parallel: Parallel, field: str, shape: Sequence[int]) -> NamedSharding:
    """NamedSharding of one page-pool array (a KVPages field); raises ShardingError when a split dim does not
    divide (e.g. a page count that does not divide by the DP attention shards)."""
    axes = POOL_AXES[field]
    parallel.check(f"pages.{field}", shape, axes)
    return parallel.sharding(axes)


def pool_format(parallel: Parallel, field: str, shape: Sequence[int]) -> NamedSharding | Format:
    """`pool_sharding`, and on a TPU mesh the array pinned row-major (XLA picks the tiling): the layout the Mosaic
    decode kernel DMAs pages from. XLA:TPU's default entry layout puts the page axis minor (no padding of the
    576-wide latent rows), so the compiled decode copied the pool to and from it on every call (2 x the pool).
    Row-major pads a row to a multiple of 128 elements (576 -> 640: 11% more bytes). A tiling cannot be pinned:
    on a multi-device mesh XLA:TPU overrides (8, 128) with (32, 128) for 8-bit pools (hence the row writes of
    `cache.pool._store_rows`: the scatter wants (8, 128)). GQA K / V are pinned head-major, [L, P, Hkv, ps, D] in
    memory: the Mosaic GQA kernels read a page as [Hkv * ps, D] rows, and row-major put a device's one kv head (TP)
    in the tiled minor dims, padding K / V 4x and the scales 128x (GLM-4.5 on v5p). GQA scales are pinned [L, Hkv,
    P, ps]: one [ps] row per (layer, head, page), (8, 128)-tiled over (P, ps), which the decode kernel reads and
    the page-row write (`cache.pool._store_page_rows`) updates in place; head-major ([L, P, 1, ps] on a device)
    was (1, 128)-tiled and the scales' scatter relaid both scale pools out every step."""
    sharding = pool_sharding(parallel, field, shape)
    if len(shape) < 2 or parallel.mesh.devices.flat[0].platform != "tpu":
        return sharding
    order = tuple(range(len(shape)))
    if field in ("k", "v"):  # GQA: a page stored head-major, [L, P, Hkv, ps, D]
        order = (0, 1, 3, 2, 4)
    elif field in ("k_scale", "v_scale"):  # GQA scales: a [ps] row per (layer, kv head, page), [L, Hkv, P, ps]
        order = (0, 3, 1, 2)
    return Format(Layout(major_to_minor=order), sharding)
