"""Put a model's weights into a phase format: FP8 (prefill) or INT4 (decode) for the quantizable tensors, or expand
quantized weights back into dense values (the compute layout)."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.models import CausalLM
from jaxserve.models.build import matmuls, rebuild
from jaxserve.quant.weight_format import QUANTIZED, WeightFormat, WeightPlan, dense_format


def _path(p: tuple) -> str:
    return ".".join(str(x) for x in p)


def quantize_model(model: CausalLM, wf: WeightFormat) -> CausalLM:
    """A copy of `model` whose quantizable Linear / Experts weights are stored in `wf.fmt` (others unchanged), with
    wf's kernel switches. A weight already quantized keeps its format. Dense formats only change the kernel
    switches. A Linear whose input dim is not a multiple of the INT4 group size stays in its dense format
    (`jaxserve quantize` refuses such a group size instead)."""
    stored = tuple((path, m.fmt) for path, m in matmuls(model) if m.fmt in QUANTIZED)
    return rebuild(model, WeightPlan(wf, stored), model.parallel)


def compute_layout(model: CausalLM, dtype: jnp.dtype, wide: bool = False, gate_up: bool = False) -> CausalLM:
    """`model` with every quantized Linear / Experts weight dequantized once into `dtype`: the layout the XLA matmul
    path computes with, for backends with no kernel for the packed format (CPU). wide: every bf16 Linear weight
    also held in f32 for one-row products (`MatmulFormat.wide`: XLA:CPU; the routed experts hold no twin); gate_up:
    every dense routed-experts block also holds gate and up as one row-major twin (`MatmulFormat.gate_up`).

    The values are the quantized format's own (the INT4 / FP8 grid times its scales, rounded to `dtype` exactly as
    the packed XLA path rounds them before its matmul each step), so outputs match the packed path; what changes is
    memory (dtype bytes per weight instead of 0.5 / 1) and that no step unpacks or rescales a weight again."""
    dense = dense_format(dtype)
    stored = tuple((path, dense if m.fmt in QUANTIZED else m.fmt) for path, m in matmuls(model))
    return rebuild(model, WeightPlan(model.weights.weights, stored, wide, gate_up), model.parallel)


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
