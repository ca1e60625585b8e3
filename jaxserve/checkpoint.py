"""jaxserve checkpoints: one Orbax pytree per group (embed, layer_000, ..., mtp), restored onto given shardings."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import CheckpointError
from jaxserve.models import CausalLM
from jaxserve.models.layers import abstract_build
from jaxserve.quant.weight_format import WeightFormat, WeightPlan
from jaxserve.format_names import canonical_format
from jaxserve.sharding import Parallel, ShardingRules, check_model, state_shardings

MANIFEST = "jaxserve.json"
ShardingFn = Callable[[str, jax.ShapeDtypeStruct], jax.sharding.Sharding]


@contextlib.contextmanager
def partial_output(out_dir: Path) -> Iterator[Path]:
    """Build a checkpoint in OUT.partial and rename it to OUT only when the block completes; on any error the
    partial folder is removed, so nothing incomplete is ever left looking like a checkpoint."""
    partial = out_dir.with_name(out_dir.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        yield partial
        partial.rename(out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def save_group(path: Path, tree: dict) -> None:
    """Write one pytree of NumPy/JAX arrays as an Orbax checkpoint at `path`."""
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(Path(path).absolute(), tree)


def read_manifest(checkpoint_dir: str | Path) -> dict:
    p = Path(checkpoint_dir) / MANIFEST
    if not p.exists():
        raise CheckpointError(f"{checkpoint_dir} is not a complete jaxserve checkpoint (no {MANIFEST})",
                              value=str(checkpoint_dir), param="checkpoint")
    return json.loads(p.read_text())


def load_config(checkpoint_dir: str | Path) -> ModelConfig:
    return ModelConfig.from_dict(read_manifest(checkpoint_dir)["model"])


def _group_of(path: tuple) -> tuple[str, tuple]:
    if path[0] == "layers":
        return f"layer_{int(path[1]):03d}", path[2:]
    if path[0] == "mtp":  # the MTP head: its norms, eh_proj and decoder layer
        return "mtp", path[1:]
    return "embed", path


def group_names(cfg: ModelConfig) -> list[str]:
    """The checkpoint's groups, in order: embed, layer_000 .. layer_{L-1}, then mtp when the model has a head."""
    return ["embed"] + [f"layer_{i:03d}" for i in range(cfg.num_layers)] + (["mtp"] if cfg.mtp_layers else [])


def _path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _default_sharding(_: str, __: jax.ShapeDtypeStruct) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def format_dir(fmt: str) -> str:
    """The params folder that `jaxserve quantize` writes format `fmt` to."""
    return f"params_{fmt}"


def _base_fmt(manifest: dict) -> str | None:
    """The runtime format name of the checkpoint's own `params/` (None when it holds quantized formats only)."""
    if manifest.get("base", True) is False:
        return None
    return {"bfloat16": "bf16", "float32": "f32"}[manifest["dtype"]]


def load_formats(checkpoint_dir: str | Path) -> list[str]:
    """The weight formats a checkpoint can be loaded in (`load(dir, weights=fmt)`): its own dtype's ("bf16" or
    "f32") when it has `params/`, plus every format `jaxserve quantize` wrote (e.g. "fp8", "int4")."""
    manifest = read_manifest(checkpoint_dir)
    base = _base_fmt(manifest)
    return ([base] if base else []) + [f for f in manifest.get("formats", {}) if f != base]


def load(checkpoint_dir: str | Path, *, dtype: jnp.dtype | None = None, sharding: ShardingFn | None = None,
         weights: str | None = None, mesh: jax.sharding.Mesh | None = None,
         rules: ShardingRules | None = None, mtp: bool = True) -> tuple[ModelConfig, CausalLM]:
    """Restore a converted checkpoint into a CausalLM.

    dtype: the model's compute/storage dtype (default: the checkpoint's). mesh (+ rules, default tensor
    parallel): every array is restored straight into its NamedSharding from its declared logical axes (each host
    reads only the shards it holds; nothing is staged whole on a host or on device 0), into a model built on that
    mesh (its per-shard paths). Otherwise sharding(path, abstract) -> the Sharding of each parameter (default: the
    first device).
    weights: a format from `load_formats` (None: the checkpoint's own `params/`). A quantized format ("fp8",
    "int4") is restored into a model built in that format (`WeightPlan`) under `nnx.eval_shape`, so no BF16 copy
    of the quantized tensors is ever materialized.
    mtp: False leaves the checkpoint's MTP head unread (the config's mtp_layers 0: no head, no MTP KV layer).
    """
    checkpoint_dir = Path(checkpoint_dir).absolute()
    weights = canonical_format(weights)  # "float8_e4m3fn" names the stored "fp8" weights
    manifest = read_manifest(checkpoint_dir)
    cfg = ModelConfig.from_dict(manifest["model"])
    cfg = cfg if mtp else dataclasses.replace(cfg, mtp_layers=0)
    dtype = dtype or {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[manifest["dtype"]]
    par = None if mesh is None else Parallel(mesh, rules or ShardingRules.tensor_parallel())
    if par is not None:
        check_model(par, cfg.num_heads, 0 if cfg.is_mla else cfg.num_kv_heads, cfg.n_routed_experts)
    base = _base_fmt(manifest)
    stored = manifest.get("formats", {})
    if weights is None or (weights == base and weights not in stored):
        if base is None:
            raise CheckpointError(f"{checkpoint_dir} holds only quantized weights {sorted(stored)}: pass weights=",
                                  value=None, param="weights")
        params_dir = checkpoint_dir / "params"
        plan = WeightPlan()
    elif weights in stored:
        spec = stored[weights]
        params_dir = checkpoint_dir / spec["dir"]
        # checkpoints written before int4_scope existed hold every MLP projection in INT4
        wf = WeightFormat(weights, int(spec["group_size"]), bool(spec["attention"]),
                          int4_scope=spec.get("int4_scope", "mlps"))
        plan = WeightPlan(wf)
    else:
        raise CheckpointError(f"checkpoint {checkpoint_dir} has no {weights!r} weights; it has "
                              f"{load_formats(checkpoint_dir)}", value=weights, param="weights")
    placed = par if par is not None and mesh.devices.size > 1 else None
    abstract = abstract_build(lambda rngs: CausalLM(cfg, dtype=dtype, rngs=rngs, weights=plan, parallel=placed))
    if par is not None:  # each parameter's NamedSharding from its declared logical axes
        shardings = {_path_str(p): v.get_value() for p, v in
                     nnx.to_flat_state(state_shardings(par, nnx.state(abstract)))}
        sharding = lambda path, _: shardings[path]  # noqa: E731
    return cfg, _restore(params_dir, abstract, sharding or _default_sharding)


def _restore(params_dir: Path, abstract: CausalLM, sharding: ShardingFn) -> CausalLM:
    """Fill an abstract model's parameters from the per-group Orbax pytrees under `params_dir`."""
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    targets: dict[str, dict] = {}
    for path, var in flat:
        group, sub = _group_of(path)
        sds = jax.ShapeDtypeStruct(var.shape, var.dtype)
        node = targets.setdefault(group, {})
        for k in sub[:-1]:
            node = node.setdefault(str(k), {})
        node[str(sub[-1])] = (sds, sharding(_path_str(path), sds))
    restored: dict[str, dict] = {}
    with ocp.PyTreeCheckpointer() as ckptr:
        for group, tree in targets.items():
            gpath = params_dir / group
            if not gpath.exists():
                raise CheckpointError(f"checkpoint group {group} is missing", value=str(gpath), param=group)
            is_leaf = lambda x: isinstance(x, tuple)  # noqa: E731
            restore_args = jax.tree.map(
                lambda t: ocp.ArrayRestoreArgs(sharding=t[1], global_shape=t[0].shape, dtype=t[0].dtype), tree,
                is_leaf=is_leaf)
            item = jax.tree.map(lambda t: t[0], tree, is_leaf=is_leaf)
            try:
                restored[group] = ckptr.restore(gpath, args=ocp.args.PyTreeRestore(item=item,
                                                                                    restore_args=restore_args))
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"checkpoint group {group} does not match the model: {e}", value=group,
                                      param=group) from e
            jax.block_until_ready(restored[group])
            _release_host_memory()  # the group's read buffers go back to the OS before the next group is read
    for path, var in flat:
        group, sub = _group_of(path)
        node = restored[group]
        for k in sub:
            node = node[str(k)]
        if tuple(node.shape) != tuple(var.shape):
            raise CheckpointError(f"parameter {_path_str(path)} has shape {node.shape}, expected {var.shape}",
                                  value=tuple(node.shape), param=_path_str(path))
        var.set_value(node)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _release_host_memory() -> None:
    """Return freed heap pages to the OS (glibc keeps them per thread arena otherwise), where glibc exists."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def group_trees(model: CausalLM) -> dict[str, dict]:
    """A model's parameters as the checkpoint's per-group nested pytrees {group: {name: ... array}} (the layout
    `load` restores)."""
    _, state = nnx.split(model)
    trees: dict[str, dict] = {}
    for path, var in nnx.to_flat_state(state):
        group, sub = _group_of(path)
        node = trees.setdefault(group, {})
        for k in sub[:-1]:
            node = node.setdefault(str(k), {})
        node[str(sub[-1])] = var.get_value()
    return trees


def model_params(model: CausalLM) -> dict[str, np.ndarray]:
    """Flat {path: array} of a model's parameters (for tests and inspection)."""
    _, state = nnx.split(model)
    return {_path_str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def save(model: CausalLM, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write `model` (dense weights) as a jaxserve checkpoint at `out_dir` (one Orbax pytree per group)."""
    out_dir = Path(out_dir)
    trees = group_trees(model)
    groups = group_names(model.cfg)
    with partial_output(out_dir) as partial:
        for g in groups:
            save_group(partial / "params" / g, trees[g])
        manifest = {"format": "jaxserve-orbax-v1", "dtype": dtype, "model": model.cfg.to_dict(),
                    "source": {"path": None, "quantization": None}, "groups": groups}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out_dir
