"""Rebuilding a CausalLM with another weight plan or placement: the model is constructed again (abstractly) with the
new `WeightPlan` / `Parallel`, and each parameter takes the old model's array, converted where a Linear's or
Experts block's format changed (a dense weight quantized, a quantized weight expanded to its dense values)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import ConfigError
from jaxserve.models.layers import DENSE_FORMATS, Experts, Linear, abstract_build
from jaxserve.models.transformer import CausalLM
from jaxserve.quant import formats
from jaxserve.quant.weight_format import WeightPlan
from jaxserve.sharding import Parallel, check_model, state_shardings

EXPERT_WEIGHTS = ("gate", "up", "down")


def matmuls(model: nnx.Module) -> Iterator[tuple[str, Linear | Experts]]:
    """(dotted path, module) of every Linear and Experts block of `model`."""
    for path, module in nnx.iter_graph(model):
        if isinstance(module, (Linear, Experts)):
            yield ".".join(map(str, path)), module


def dtype_of(model: CausalLM) -> jnp.dtype:
    """The model's activation dtype (its embedding table's)."""
    return model.embed.get_value().dtype


def _convert(src: jax.Array, scale: jax.Array | None, src_fmt: str, dst: Linear | Experts, name: str,
             dst_var: nnx.Variable, group_size: int) -> tuple[jax.Array, jax.Array | None]:
    """One weight (and its scale) from `src_fmt` into `dst.fmt`."""
    if src_fmt in DENSE_FORMATS and dst.fmt not in DENSE_FORMATS:
        return formats.quantize(src.astype(jnp.float32), dst.fmt, group_size)
    if src_fmt not in DENSE_FORMATS and dst.fmt in DENSE_FORMATS:
        return formats.dequantize(src, scale, src_fmt).astype(dst_var.get_value().dtype), None
    raise ConfigError(f"{name} is stored as {src_fmt}, which cannot be rebuilt as {dst.fmt}", value=src_fmt,
                      param="weights")


def _converted(model: nnx.Module, target: nnx.Module, group_size: int) -> dict[str, jax.Array]:
    """{parameter path: array} of the target's matmul weights whose format differs from the model's."""
    source = dict(matmuls(model))
    out: dict[str, jax.Array] = {}
    for path, dst in matmuls(target):
        src = source[path]
        pairs = ((("weight", "scale"),) if isinstance(dst, Linear)
                 else tuple((n, f"{n}_scale") for n in EXPERT_WEIGHTS))
        for w_name, s_name in pairs:
            # a new f32 twin (MatmulFormat.wide: Linear only, the routed experts hold none)
            new_wide = isinstance(dst, Linear) and dst.wide is not None and src.wide is None
            if src.fmt == dst.fmt and not new_wide:
                continue  # carried over as it is (and never read: abstract builds hold no values)
            s = getattr(src, s_name)
            w = getattr(src, w_name)[...]
            if src.fmt != dst.fmt:
                w, scale = _convert(w, None if s is None else s[...], src.fmt, dst, f"{path}.{w_name}",
                                    getattr(dst, w_name), group_size)
                out[f"{path}.{w_name}"] = w
                if scale is not None:
                    out[f"{path}.{s_name}"] = scale
            if new_wide:
                out[f"{path}.wide"] = w.astype(jnp.float32)
        if isinstance(dst, Experts) and dst.gate_up is not None and src.gate_up is None:
            # a new gate_up twin (MatmulFormat.gate_up), from the block's gate and up as the target holds them
            gate, up = (out[f"{path}.{n}"] if f"{path}.{n}" in out else getattr(src, n)[...] for n in ("gate", "up"))
            out[f"{path}.gate_up"] = Experts.gate_up_of(gate, up)
    return out


def rebuild(model: CausalLM, weights: WeightPlan, parallel: Parallel | None, cfg: ModelConfig | None = None
            ) -> CausalLM:
    """`model` built again with `weights` and `parallel` (same dtype; same config unless `cfg` gives one whose
    parameters are a subset, e.g. without the MTP head); its arrays are carried over (the same arrays, where they
    are), converted where a matmul weight's format changes. `model` is unchanged."""
    cfg, dtype = cfg or model.cfg, dtype_of(model)
    abstract = abstract_build(lambda rngs: CausalLM(cfg, dtype=dtype, rngs=rngs, weights=weights, parallel=parallel))
    converted = _converted(model, abstract, weights.weights.group_size)
    graphdef, state = nnx.split(abstract)
    old = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))}
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        name = ".".join(map(str, path))
        value = converted[name] if name in converted else old[name].get_value()
        want = var.get_value()
        if tuple(value.shape) != tuple(want.shape) or value.dtype != want.dtype:
            raise ConfigError(f"{name}: {value.dtype}{list(value.shape)} does not fit the rebuilt model's "
                              f"{want.dtype}{list(want.shape)}", value=name, param="weights")
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def drop_mtp(model: CausalLM) -> CausalLM:
    """`model` without its MTP head (mtp_layers 0: its KV layout has no MTP layer); `model` itself if it has none."""
    if model.mtp is None:
        return model
    return rebuild(model, model.weights, model.parallel, replace(model.cfg, mtp_layers=0))


def shard_model(model: CausalLM, par: Parallel | None) -> CausalLM:
    """`model` rebuilt on `par` (None: single-device): its modules run their per-shard paths there. Checks every
    parameter's layout first: a dim that does not divide raises ShardingError."""
    cfg = model.cfg
    if par is not None:
        check_model(par, cfg.num_heads, 0 if cfg.is_mla else cfg.num_kv_heads, cfg.n_routed_experts)
        state_shardings(par, nnx.state(model))
    return rebuild(model, model.weights, par)
