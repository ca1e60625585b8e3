"""Real compiles on this CPU host, no device: XLA:GPU + Triton -> sm_90a cubin for an H200, XLA:TPU + Mosaic (libtpu)
for TPU v5e / v5p / v6e, against compile-only topology devices (jax.experimental.topologies).

`compile_for(target, fn, *args)` jits fn over ShapeDtypeStructs placed on one device of the target and returns a
`Compiled` result with what the compiler reported: Triton kernels' allocated shared memory (from the compile's
own `*thunk_sequence.txt` dump), Mosaic kernels' scoped VMEM (the `used_scoped_memory_configs` XLA:TPU writes on
each compiled `tpu_custom_call`), and the compiled HLO text. The shapes are per device: the engine calls the
kernels inside shard_map, so one device of the topology is enough.

Target configs: jaxserve/target_configs/h200.txtpb and h100_sxm.txtpb (package data, also read by `jaxserve plan
--target`) are copies of shared/gpu_target_configs/ (XLA's own device specs, openxla/xla
xla/backends/gpu/target_config/specs/, minus `collective_memory_granularity`, which jaxlib 0.10.2's XLA does not
know).
"""
from __future__ import annotations

import functools
import glob
import json
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from jax.experimental import topologies
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve import hlo_bytes

TARGETS_DIR = Path(__file__).resolve().parents[2] / "jaxserve" / "target_configs"
# target name -> (platform, topology); TPU names as libtpu spells them, GPU as slices x hosts x GPUs per host
TARGETS = {
    "h200": ("cuda", "1x1x1"),
    "v5e": ("tpu", "v5e:2x4"),
    "v5p": ("tpu", "v5p:2x2x1"),
    "v6e": ("tpu", "v6e:2x4"),
}
TPU_TARGETS = ("v5e", "v5p", "v6e")
ALL_TARGETS = ("h200", *TPU_TARGETS)
# H200 (sm_90a) opt-in shared memory per block, as the compiler reports it ("available: 232448")
H200_SMEM_BYTES = 232_448
_THUNK = re.compile(r"\] (\S+) grid: \[[^\]]*\] threads: \[[^\]]*\]\s+shared_memory: (\d+) bytes")
_TPU_CALL = re.compile(r"custom_call_target=\"tpu_custom_call\".*?backend_config=(\{.*\})")


@functools.cache
def device(target: str) -> jax.Device:
    """One compile-only device of `target` (no hardware needed)."""
    platform, topology = TARGETS[target]
    if platform == "cuda":
        config = (TARGETS_DIR / "h200.txtpb").read_text()
        desc = topologies.get_topology_desc(platform="cuda", topology=topology, target_config=config)
    else:
        desc = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    return desc.devices[0]


@functools.cache
def mesh(target: str) -> Mesh:
    return Mesh(np.array([device(target)]), ("d",))


def row_major(ndim: int) -> Layout:
    """The layout Mosaic requires of its operands (major_to_minor 0..ndim-1), tiling left to the compiler."""
    return Layout(major_to_minor=tuple(range(ndim)))


def sds(target: str, shape: Sequence[int], dtype: object, layout: Layout | None = None) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct placed on `target`'s device; layout: pinned (else the target's default layout)."""
    sharding = NamedSharding(mesh(target), PartitionSpec())
    if layout is not None:
        sharding = Format(layout, sharding)
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=sharding)


@dataclass
class Compiled:
    """What the compiler reported for one program."""

    hlo: str
    smem: dict[str, int] = field(default_factory=dict)  # Triton kernel name -> shared memory allocated (bytes)
    vmem: list[int] = field(default_factory=list)  # per Mosaic call: scoped VMEM used (bytes)
    temp_bytes: int = 0  # the program's HBM temporaries


def compile_for(target: str, fn: Callable, *args: jax.ShapeDtypeStruct) -> Compiled:
    """Compile jax.jit(fn)(*args) for `target`; raises what the compiler raises (e.g. RESOURCE_EXHAUSTED)."""
    platform = TARGETS[target][0]
    with tempfile.TemporaryDirectory() as dump, jax.set_mesh(mesh(target)):
        # the dump is read for the Triton launch parameters (shared memory per kernel) only
        options = {"xla_dump_to": dump} if platform == "cuda" else {}
        compiled = jax.jit(fn).lower(*args).compile(compiler_options=options)
        thunks = "".join(Path(p).read_text() for p in glob.glob(f"{dump}/*thunk_sequence.txt"))
    hlo = compiled.as_text()
    out = Compiled(hlo=hlo, temp_bytes=compiled.memory_analysis().temp_size_in_bytes)
    for name, smem in _THUNK.findall(thunks):
        out.smem[name] = max(out.smem.get(name, 0), int(smem))
    for config in _TPU_CALL.findall(hlo):
        used = json.loads(config).get("used_scoped_memory_configs", [])
        out.vmem.append(sum(int(u["size"]) for u in used))
    return out


def kernel_smem(result: Compiled, name: str) -> int:
    """Shared memory the compiler allocated for the Triton kernel `name` (a pallas_call's name)."""
    hits = [v for k, v in result.smem.items() if k.startswith(name)]
    assert hits, f"no Triton kernel {name!r} in {sorted(result.smem)}"
    return max(hits)


def check_budget(target: str, result: Compiled, kernel: str | None = None) -> None:
    """H200: the Triton kernel `kernel` (else every one) within the compiler's shared-memory limit; TPU: every Mosaic
    call reported its scoped VMEM (Mosaic refuses one over its limit at compile time)."""
    if TARGETS[target][0] == "cuda":
        used = kernel_smem(result, kernel) if kernel else max(result.smem.values(), default=0)
        assert 0 < used <= H200_SMEM_BYTES, result.smem
    else:
        assert result.vmem and all(v > 0 for v in result.vmem), result.vmem


def copies_of(result: Compiled, shape: Sequence[int]) -> list[str]:
    """HLO `copy` instructions producing an array of `shape` (e.g. a whole page pool relaid out for a call)."""
    dims = ",".join(str(d) for d in shape)
    return [line.strip() for line in result.hlo.splitlines()
            if re.search(rf"= \w+\[{dims}\]\{{[^}}]*\}} copy\(", line)]


def mosaic_operands_in_vmem(result: Compiled, name: str) -> list[tuple[bool, ...]]:
    """Per Mosaic call whose metadata names `name`: whether XLA:TPU placed each operand in VMEM (`S(1)` in its
    layout), i.e. prefetched it there, where an operand left in HBM is read by the kernel's own DMAs."""
    comps, _ = hlo_bytes.parse(result.hlo)
    calls = []
    for instrs in comps.values():
        by_name = {i.name: i for i in instrs}
        for call in instrs:
            if call.op == "custom-call" and "tpu_custom_call" in call.attrs and name in call.attrs:
                srcs = [by_name.get(o) for o in call.operands]
                calls.append(tuple(s is not None and any(not s.in_hbm(j) for j in range(len(s.types)))
                                   for s in srcs))
    return calls


class NoPool:
    """No page pool, for a bare block's compile (plan_compile._tracked_shapes reads these fields)."""

    latent = latent_scale = k = v = k_scale = v_scale = index_k = index_k_scale = None
