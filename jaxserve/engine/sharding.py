"""Where each parameter and KV pool array lives on a 1-D tensor-parallel mesh ("tp").

Attention is split over heads (column-parallel q/k/v/kv_b, row-parallel o), dense and shared MLPs and routed
experts over their FFN dim (or experts over the mesh with expert_parallel). A dim that does not divide by the mesh
size stays replicated. The MLA latent cache is replicated (every head reads the same row); GQA K/V split by kv head.
"""
from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.cache import KVPages
from jaxserve.config import ModelConfig

AXIS = "tp"

# (module-path regex, axis to split counted from the end of the weight's shape)
_COLUMN, _ROW, _EXPERT = -1, -2, -3
_RULES: tuple[tuple[str, int], ...] = (
    (r"attn\.(q_b|q_proj|kv_b|q|k|v)$", _COLUMN),
    (r"attn\.o$", _ROW),
    (r"mlp(\.shared)?\.(gate|up)$", _COLUMN),
    (r"mlp(\.shared)?\.down$", _ROW),
)


def make_mesh(devices: list[jax.Device]) -> Mesh:
    return Mesh(np.array(devices), (AXIS,))


def _split_axis(path: str, expert_parallel: bool) -> int | None:
    module, _, leaf = path.rpartition(".")
    if re.search(r"mlp\.experts$", module):
        if expert_parallel:
            return _EXPERT
        name = leaf.removesuffix("_scale")
        return _COLUMN if name in ("gate", "up") else _ROW  # split the FFN dim I of [E, H, I] / [E, I, H]
    for pattern, axis in _RULES:
        if re.search(pattern, module):
            return axis if leaf != "bias" or axis == _COLUMN else None
    return None


def param_spec(path: str, shape: tuple[int, ...], mesh_size: int, *, expert_parallel: bool = False) -> P:
    """PartitionSpec of the parameter at NNX path `path` (e.g. layers.3.mlp.experts.gate)."""
    axis = _split_axis(path, expert_parallel)
    if axis is None or mesh_size == 1 or len(shape) < -axis:
        return P()
    dim = len(shape) + axis
    if shape[dim] % mesh_size:
        return P()
    spec = [None] * len(shape)
    spec[dim] = AXIS
    return P(*spec)


def pages_sharding(pages: KVPages, mesh: Mesh, cfg: ModelConfig) -> KVPages:
    """A KVPages-shaped tree of NamedShardings for the pool."""
    n = mesh.devices.size

    def spec(x: jax.Array | None) -> NamedSharding | None:
        if x is None:
            return None
        if pages.layout.kind == "gqa" and n > 1 and cfg.num_kv_heads % n == 0:
            s = [None] * x.ndim
            s[3] = AXIS  # [L, P, ps, kv_heads, ...]
            return NamedSharding(mesh, P(*s))
        return NamedSharding(mesh, P())

    return jax.tree.map(spec, pages)
