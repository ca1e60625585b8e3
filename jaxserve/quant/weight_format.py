"""What format each matmul weight of a model is built in: the model-wide `WeightFormat` a phase asks for, the
`WeightPlan` a model is constructed with (that format, plus the formats of weights already stored otherwise), and
the per-module `MatmulFormat` a Linear or Experts block receives from its parent."""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from jaxserve.format_names import canonical_format
from jaxserve.quant import formats

QUANTIZED = ("fp8", "int4")


def dense_format(dtype: jnp.dtype) -> str:
    """The dense format of a weight stored in `dtype`: "f32" or "bf16"."""
    return "f32" if jnp.dtype(dtype) == jnp.float32 else "bf16"


@dataclass(frozen=True)
class WeightFormat:
    """fmt: "bf16" | "f32" | "fp8" | "int4"; attention: also quantize attention projections;
    use_kernel/interpret: Pallas kernels for the quantized matmuls (interpret on CPU); backend: their tiling,
    "gpu" (Triton) or "tpu" (Mosaic); int4_scope: which MLP tensors INT4 covers, "experts" (routed experts, as
    Kimi's INT4 checkpoints) or "mlps" (shared experts and dense MLPs too; see `formats.INT4_SCOPES`)."""

    fmt: str = "bf16"
    group_size: int = 32
    attention: bool = False
    use_kernel: bool = False
    interpret: bool = False
    backend: str = "gpu"
    int4_scope: str = "experts"

    def __post_init__(self) -> None:
        # accept the dtype names users type ("bfloat16", "float8_e4m3fn", ...)
        object.__setattr__(self, "fmt", formats.check_fmt(canonical_format(self.fmt)))
        formats.check_int4_scope(self.int4_scope)


@dataclass(frozen=True)
class MatmulFormat:
    """One Linear's or Experts block's weight format: fmt None keeps the module's dense dtype; group_size: the INT4
    group along the input dim; use_kernel/interpret/backend: as `WeightFormat`; wide: a Linear's bf16 weight also
    held as f32 for products of one row per matrix (XLA:CPU converts a bf16 weight to f32 for every matrix-vector
    dot, and runs bf16 natively from two rows on: the two copies give both the same values as before). Experts
    ignore it: their gathers convert only the gathered experts. gate_up: a single-device dense Experts block also
    holds its gate and up weights as one [H, 2, E, I] twin (`Experts.dense_all`'s two-dimensional product; Linear
    ignores it)."""

    fmt: str | None = None
    group_size: int = 32
    use_kernel: bool = False
    interpret: bool = False
    backend: str = "gpu"
    wide: bool = False
    gate_up: bool = False

    def resolve(self, dtype: jnp.dtype) -> str:
        """The stored format of a module whose dense dtype is `dtype`."""
        return dense_format(dtype) if self.fmt is None else self.fmt


@dataclass(frozen=True)
class WeightPlan:
    """The format of every matmul weight of a model, by module path (`layers.3.attn.q`, `layers.3.mlp.experts`):
    `stored` first (weights that already hold a format, kept as they are), else `weights`' rules (quantizable
    tensors in weights.fmt when it is quantized; a Linear whose input dim is not a multiple of the INT4 group size
    stays dense), else the module's dense dtype."""

    weights: WeightFormat = WeightFormat()
    stored: tuple[tuple[str, str], ...] = ()
    wide: bool = False  # every bf16 Linear weight also held in f32 (`MatmulFormat.wide`)
    gate_up: bool = False  # dense routed experts also hold gate and up as one row-major twin (`MatmulFormat.gate_up`)

    def _format(self, fmt: str | None) -> MatmulFormat:
        w = self.weights
        return MatmulFormat(fmt, w.group_size, w.use_kernel, w.interpret, w.backend, self.wide, self.gate_up)

    def linear(self, path: str, din: int) -> MatmulFormat:
        """The format of the Linear at `path` with input dim `din`."""
        stored = dict(self.stored).get(path)
        if stored is not None:
            return self._format(stored)
        w = self.weights
        quantize = w.fmt in QUANTIZED and formats.quantizable(path, w.fmt, attention=w.attention,
                                                              int4_scope=w.int4_scope)
        fits = din % (w.group_size if w.fmt == "int4" else 1) == 0
        return self._format(w.fmt if quantize and fits else None)

    def experts(self, path: str) -> MatmulFormat:
        """The format of the routed Experts block at `path` (every quantized format covers routed experts)."""
        stored = dict(self.stored).get(path)
        if stored is not None:
            return self._format(stored)
        return self._format(self.weights.fmt if self.weights.fmt in QUANTIZED else None)
