"""`jaxserve quantize CKPT OUT`: write a checkpoint holding the decode (INT4) weights beside the prefill (FP8) ones.

OUT layout (same group split as the source, one Orbax pytree per group):

    OUT/jaxserve.json            manifest: the source's, plus "base": false and "formats" {fmt: {dir, role,
                                 group_size, attention, bytes, expert_bytes}} (bytes include the scales)
    OUT/params_fp8/<group>       prefill weights (quantizable tensors FP8 e4m3 + f32 128x128 tile scales)
    OUT/params_int4/<group>      decode weights (quantizable tensors packed INT4 + bf16 group scales)
    OUT/config.json, tokenizer*  copied from the source

Each format's folder is self-contained (the unquantized tensors, embeddings / norms / router, are stored in both)
so `jaxserve.checkpoint.load(OUT, weights="int4")` restores a decode model without reading the FP8 one.
"""
from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from flax import nnx
from tqdm import tqdm

from jaxserve.checkpoint import (MANIFEST, format_dir, group_trees, load, load_formats, partial_output, read_manifest,
                                 save_group)
from jaxserve.errors import CheckpointError, ConfigError
from jaxserve.format_names import canonical_format
from jaxserve.models import CausalLM
from jaxserve.models.layers import Linear
from jaxserve.quant import formats
from jaxserve.quant.apply import quantize_model, weight_bytes
from jaxserve.quant.weight_format import WeightFormat

QUANTIZED_FORMATS = ("fp8", "int4")


@dataclass(frozen=True)
class QuantizeSpec:
    """weights: the decode format; prefill_weights: the prefill format (None: write the decode format only);
    group_size: INT4 group along the input dim; attention: also quantize the attention projections;
    int4_scope: "experts" (routed experts only, Kimi's INT4 recipe) or "mlps" (shared experts, dense MLPs too)."""

    weights: str = "int4"
    prefill_weights: str | None = "fp8"
    group_size: int = 32
    attention: bool = False
    int4_scope: str = "experts"

    def __post_init__(self) -> None:
        for param in ("weights", "prefill_weights"):
            v = canonical_format(getattr(self, param))  # accept "float8_e4m3fn", "uint4", ...
            object.__setattr__(self, param, v)
            if v not in QUANTIZED_FORMATS and not (param == "prefill_weights" and v is None):
                raise ConfigError(f"--{param.replace('_', '-')} must be one of {QUANTIZED_FORMATS}, got {v!r}",
                                  value=v, param=param)
        if not isinstance(self.group_size, int) or self.group_size <= 0 or self.group_size % 2:
            raise ConfigError(f"--group-size must be a positive even integer, got {self.group_size!r}",
                              value=self.group_size, param="group_size")
        formats.check_int4_scope(self.int4_scope)

    def roles(self) -> dict[str, str]:
        """{fmt: "prefill" | "decode" | "prefill+decode"} in writing order (prefill first)."""
        if self.prefill_weights is None or self.prefill_weights == self.weights:
            return {self.weights: "decode" if self.prefill_weights is None else "prefill+decode"}
        return {self.prefill_weights: "prefill", self.weights: "decode"}


def quantize_checkpoint(src: str | Path, out: str | Path, spec: QuantizeSpec = QuantizeSpec(), *,
                        progress: bool = True) -> dict:
    """Quantize checkpoint `src` (BF16 or F32 `params/`) into a new folder `out` -> the written manifest.

    The whole source model is held in memory once, plus one quantized copy at a time (each format is written,
    then dropped). Raises CheckpointError (missing/incomplete source, existing out, quantized-only source) and
    ConfigError (a group size that does not divide a quantized tensor's input dim).
    """
    src, out = Path(src), Path(out)
    manifest = read_manifest(src)
    if out.exists():
        raise CheckpointError(f"output folder {out} already exists", value=str(out), param="out_dir")
    have = load_formats(src)
    if not have or have[0] not in ("bf16", "f32"):
        raise CheckpointError(f"{src} has no BF16/F32 weights to quantize (it has {have})", value=have,
                              param="checkpoint")
    _, model = load(src)
    formats: dict[str, dict] = {}
    with partial_output(out) as partial:
        for fmt, role in spec.roles().items():
            wf = WeightFormat(fmt, spec.group_size, spec.attention, int4_scope=spec.int4_scope)
            qmodel = _quantize(model, wf)
            trees = group_trees(qmodel)
            for group in tqdm(manifest["groups"], desc=f"write {fmt}", unit="group", disable=not progress):
                save_group(partial / format_dir(fmt) / group, trees[group])
            formats[fmt] = {"dir": format_dir(fmt), "role": role, "group_size": spec.group_size,
                            "attention": spec.attention, "int4_scope": spec.int4_scope, "bytes": weight_bytes(qmodel),
                            "expert_bytes": weight_bytes(qmodel, experts_only=True)}
            del qmodel, trees
        for f in src.iterdir():
            if f.is_file() and f.name != MANIFEST:
                shutil.copy2(f, partial / f.name)
        new = dict(manifest)
        new.update(base=False, formats=formats, quantized_from=str(src.absolute()),
                   source_weights={"fmt": have[0], "bytes": weight_bytes(model),
                                   "expert_bytes": weight_bytes(model, experts_only=True)})
        (partial / MANIFEST).write_text(json.dumps(new, indent=1))
    return new


def _quantize(model: CausalLM, wf: WeightFormat) -> CausalLM:
    """quantize_model, refusing a group size that would silently leave a quantizable Linear unquantized."""
    if wf.fmt == "int4":
        for path, module in nnx.iter_graph(model):
            name = ".".join(str(p) for p in path)
            if isinstance(module, Linear) and formats.quantizable(name, wf.fmt, attention=wf.attention,
                                                                            int4_scope=wf.int4_scope) \
                    and module.weight.shape[0] % wf.group_size:
                raise ConfigError(f"--group-size {wf.group_size} does not divide the input dim "
                                  f"{module.weight.shape[0]} of {name}", value=wf.group_size, param="group_size")
    return quantize_model(model, wf)


def memory_table(manifest: dict) -> str:
    """A text table of weight memory per format: total and routed experts only, with ratios to the source."""
    src = manifest["source_weights"]
    rows = [(src["fmt"] + " (source)", src["bytes"], src["expert_bytes"])]
    rows += [(f"{fmt} ({v['role']})", v["bytes"], v["expert_bytes"]) for fmt, v in manifest["formats"].items()]
    lines = [f"{'format':<22}{'total MiB':>12}{'vs source':>11}{'experts MiB':>13}{'vs source':>11}"]
    for name, total, experts in rows:
        lines.append(f"{name:<22}{total / 2**20:>12.3f}{total / src['bytes']:>11.3f}"
                     f"{experts / 2**20:>13.3f}{experts / max(src['expert_bytes'], 1):>11.3f}")
    f = manifest["formats"]
    if "int4" in f and "fp8" in f:
        lines.append(f"int4 / fp8: total {f['int4']['bytes'] / f['fp8']['bytes']:.3f}, "
                     f"experts {f['int4']['expert_bytes'] / f['fp8']['expert_bytes']:.3f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="source jaxserve checkpoint (BF16/F32 params)")
    p.add_argument("out_dir", help="output folder (must not exist)")
    p.add_argument("--weights", default="int4", help="decode weight format: int4 | fp8")
    p.add_argument("--group-size", type=int, default=32, help="INT4 group size along the input dim")
    p.add_argument("--prefill-weights", default="fp8", help="prefill weight format: fp8 | int4 | none")
    p.add_argument("--attention", action="store_true", help="also quantize attention projections")
    p.add_argument("--int4-scope", default="experts", choices=sorted(formats.INT4_SCOPES),
                   help="INT4 tensors: routed experts only (Kimi's INT4 recipe) or every MLP projection")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    prefill = None if args.prefill_weights == "none" else args.prefill_weights
    spec = QuantizeSpec(args.weights, prefill, args.group_size, args.attention, args.int4_scope)
    manifest = quantize_checkpoint(args.checkpoint, args.out_dir, spec, progress=not args.no_progress)
    print(memory_table(manifest))
    print(f"wrote {args.out_dir}")
    return 0
