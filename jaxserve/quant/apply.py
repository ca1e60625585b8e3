"""Put a model's weights into a phase format: FP8 (prefill) or INT4 (decode) for the quantizable tensors."""
from __future__ import annotations

from dataclasses import dataclass


import jax.numpy as jnp
from flax import nnx

from jaxserve.format_names import canonical_format
from jaxserve.quant import formats


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


def _path(p: tuple) -> str:
    return ".".join(str(x) for x in p)


def _in_scope(name: str, wf: WeightFormat) -> bool:
    return formats.quantizable(name, wf.fmt, attention=wf.attention, int4_scope=wf.int4_scope)


def quantize_model(model: nnx.Module, wf: WeightFormat) -> nnx.Module:
    """A copy of `model` whose quantizable Linear / Experts weights are stored in `wf.fmt` (others unchanged).
    Dense formats only change the kernel switches. A Linear whose input dim is not a multiple of the INT4 group
    size stays in its dense format (`jaxserve quantize` refuses such a group size instead)."""
    from jaxserve.models.layers import Experts, Linear

    formats.check_fmt(wf.fmt)
    out = nnx.clone(model)
    quantized = wf.fmt in ("fp8", "int4")
    for path, module in nnx.iter_graph(out):
        if isinstance(module, Linear):
            name = _path(path)
            module.use_kernel, module.interpret, module.backend = wf.use_kernel, wf.interpret, wf.backend
            if quantized and module.fmt in ("bf16", "f32") and _in_scope(name, wf) \
                    and module.weight.shape[0] % (wf.group_size if wf.fmt == "int4" else 1) == 0:
                w, s = formats.quantize(module.weight[...].astype(jnp.float32), wf.fmt, wf.group_size)
                module.weight = nnx.Param(w)
                module.scale = nnx.Param(s)
                module.fmt = wf.fmt
        elif isinstance(module, Experts):
            module.use_kernel, module.interpret, module.backend = wf.use_kernel, wf.interpret, wf.backend
            if quantized and module.fmt in ("bf16", "f32"):
                for name in ("gate", "up", "down"):
                    w, s = formats.quantize(getattr(module, name)[...].astype(jnp.float32), wf.fmt, wf.group_size)
                    setattr(module, name, nnx.Param(w))
                    setattr(module, f"{name}_scale", nnx.Param(s))
                module.fmt = wf.fmt
    return out


def compute_layout(model: nnx.Module, dtype: jnp.dtype) -> nnx.Module:
    """`model` (in place) with every quantized Linear / Experts weight dequantized once into `dtype`: the layout the
    XLA matmul path computes with, for backends with no kernel for the packed format (CPU).

    The values are the quantized format's own (the INT4 / FP8 grid times its scales, rounded to `dtype` exactly as
    the packed XLA path rounds them before its matmul each step), so outputs match the packed path; what changes is
    memory (dtype bytes per weight instead of 0.5 / 1) and that no step unpacks or rescales a weight again."""
    from jaxserve.models.layers import Experts, Linear

    dense = "f32" if jnp.dtype(dtype) == jnp.float32 else "bf16"
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and module.fmt in ("fp8", "int4"):
            module.weight, module.scale = nnx.Param(module.dense_weight().astype(dtype)), nnx.data(None)
            module.fmt = dense
        elif isinstance(module, Experts) and module.fmt in ("fp8", "int4"):
            for name in ("gate", "up", "down"):
                w = formats.dequantize(getattr(module, name)[...], getattr(module, f"{name}_scale")[...], module.fmt)
                setattr(module, name, nnx.Param(w.astype(dtype)))
                setattr(module, f"{name}_scale", nnx.data(None))
            module.fmt = dense
    return model


def weight_bytes(model: nnx.Module, *, experts_only: bool = False) -> int:
    """Bytes of the model's parameters (quantized weights with their scales), optionally routed experts only."""
    _, state = nnx.split(model)
    total = 0
    for path, var in nnx.to_flat_state(state):
        if experts_only and ".mlp.experts." not in f".{_path(path)}":
            continue
        v = var.get_value()
        total += int(v.size) * jnp.dtype(v.dtype).itemsize
    return total


