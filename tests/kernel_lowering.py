"""Cross-lowering helpers for the kernel tests: lower a jitted function for CUDA or TPU on this CPU host, and
the per-pipeline-stage byte budgets the BlockSpecs must fit.

`lower_for(fn, *args, platform=...)` runs `jax.export` for one platform and returns the StableHLO text; a
kernel that cannot lower raises there (e.g. Mosaic GPU's shared-memory check, Mosaic TPU's block-shape rule).
Triton custom calls carry no serialization-compatibility guarantee, so that one safety check is disabled:
we lower, we never ship the artifact.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import numpy as np

# H200 (sm_90): at most 227 KiB of shared memory per thread block (232,448 bytes opt-in).
H200_SMEM_BYTES = 232_448
# Mosaic TPU's default scoped-VMEM limit for one kernel; a kernel may raise it with vmem_limit_bytes.
TPU_SCOPED_VMEM_BYTES = 32 * 2**20
TPU_SMEM_BYTES = 1 * 2**20
# The chip the TPU lowering tests declare (device_kind of lower_for): v6e (Trillium) has FP8-capable Mosaic and
# the 32 MiB default scoped VMEM above.
TPU_V6E = "TPU v6 lite"

_TRITON_TARGET = "__gpu$xla.gpu.triton"


def lower_for(fn: Callable, *args: object, platform: str, device_kind: str | None = None) -> str:
    """StableHLO text of `jax.jit(fn)(*args)` exported for `platform` ("cuda" or "tpu"); args may be
    jax.ShapeDtypeStruct. Raises whatever the lowering raises.

    device_kind: a chip to declare for lowerings that query the target's hardware (Pallas TPU asks for it, e.g.
    for 1-D block rules; on this CPU host there is no TPU to ask), e.g. TPU_V6E. It is set through an abstract
    mesh of one device for the duration of the export only.
    """
    checks = [jax.export.DisabledSafetyCheck.custom_call(_TRITON_TARGET)] if platform == "cuda" else []
    export = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)
    if device_kind is None:
        return export(*args).mlir_module()
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform=platform)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("chip",), abstract_device=device)):
        return export(*args).mlir_module()


def sds(shape: Sequence[int], dtype: object) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype) if not hasattr(dtype, "dtype") else dtype)


def stage_bytes(blocks: Sequence[tuple[Sequence[int], object]], buffers: int = 2) -> int:
    """Bytes one pipeline stage holds: the sum of each (block shape, dtype), times the buffering factor."""
    return buffers * sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in blocks)


def tpu_padded(shape: Sequence[int], dtype: object) -> tuple[int, ...]:
    """A VMEM buffer's footprint shape: the last dim padded to 128 lanes, the second-last to 8 sublanes times the
    dtype's packing (16 for bf16, 32 for 8-bit), as Mosaic's native tiling lays it out."""
    if len(shape) == 0:
        return ()
    *lead, last = shape
    packing = max(1, 4 // np.dtype(dtype).itemsize)
    if not lead:
        return (-(-last // 128) * 128,)
    *lead, second = lead
    return (*lead, -(-second // (8 * packing)) * 8 * packing, -(-last // 128) * 128)


def tpu_vmem_bytes(blocks: Sequence[tuple[Sequence[int], object]], buffers: int = 2) -> int:
    """stage_bytes over the tile-padded shapes (see tpu_padded)."""
    return stage_bytes([(tpu_padded(shape, dtype), dtype) for shape, dtype in blocks], buffers)


def within(used: int, budget: int, what: str) -> None:
    """Raise AssertionError naming `what` when `used` bytes exceed `budget`."""
    if used > budget:
        raise AssertionError(f"{what}: {used:,} bytes > budget {budget:,}")
