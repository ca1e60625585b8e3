"""HF safetensors folder -> jaxserve Orbax checkpoint (`jaxserve convert HF_DIR OUT_DIR`).

Reads the three weight layouts real Kimi / GLM checkpoints ship: plain BF16/F32; FP8 e4m3 with block scales
(`weight_scale_inv`, `quantization_config.weight_block_size`) or per-channel `weight_scale` (compressed-tensors
float-quantized); compressed-tensors `pack-quantized` INT4 (`weight_packed`, `weight_scale`, `weight_shape`).
compressed-tensors configs with several `config_groups` (e.g. INT8 attention + INT4 experts, as third-party
GLM-5.x quantizations ship) are read group by group: each linear takes the group whose `targets` match its module
name (an exact name first, then a `re:` regex, then the class name `Linear`), unless `ignore` lists it; groups may
be pack-quantized INT4/INT8 (int32 words), int-quantized INT8 (`weight` I8) or float-quantized FP8, per group
(`format` in the group, else the config's), with group or per-channel scales.
Weights are dequantized to `--dtype` (phase formats are made later by `jaxserve quantize`).

Output layout (one Orbax pytree per group, so conversion and restore hold one layer at a time):
  OUT_DIR/jaxserve.json       ModelConfig + dtype + source description, written last (marks completion)
  OUT_DIR/config.json, tokenizer files copied from HF_DIR
  OUT_DIR/params/embed        {"embed", "norm", "lm_head"}
  OUT_DIR/params/layer_000 .. layer_{L-1}
  OUT_DIR/params/mtp          the MTP head (layer num_hidden_layers: enorm, hnorm, eh_proj, its decoder layer,
                              shared_head.norm) when the checkpoint has its tensors; else the config's mtp_layers is 0
The output is built in OUT_DIR.partial and renamed at the end; on any error the partial folder is removed.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
from tqdm import tqdm

from jaxserve.convert.safetensors_io import SafetensorsFolder
from jaxserve.config import ModelConfig, from_hf_config
from jaxserve.errors import CheckpointError, ConfigError
from jaxserve.models.rope import interleave_to_half_split
from jaxserve.quant import hf_formats

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "tokenizer.model")
MANIFEST = "jaxserve.json"
DTYPE_NAMES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32"}  # what users type
FP8_STORED = {"e4m3": "F8_E4M3", "e5m2": "F8_E5M2"}  # quantization_config.fmt -> safetensors dtype
FLOAT_STORED = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class WeightGroup:
    """One compressed-tensors config group: the modules it targets and how their weights are stored."""

    name: str
    targets: tuple[str, ...]
    scheme: QuantScheme


@dataclass(frozen=True)
class QuantScheme:
    """How quantized linears are stored in the source checkpoint. A compressed-tensors config with several groups
    is method "groups": `for_module` gives each linear its own group's scheme."""

    method: str  # "none" | "fp8_block" | "fp8_channel" | "int4_pack" | "int8_pack" | "int8" | "groups"
    block: tuple[int, int] = (128, 128)
    group_size: int | None = 32  # None: one scale per output channel
    fp8_fmt: str = "e4m3"  # the FP8 element format the config declares (DeepSeek's `fmt`)
    groups: tuple[WeightGroup, ...] = ()
    ignore: tuple[str, ...] = ()

    @property
    def num_bits(self) -> int:
        return 8 if self.method in ("int8_pack", "int8") else 4

    def declared(self) -> str:
        return {"fp8_block": f"FP8 {self.fp8_fmt} (block scales)", "fp8_channel": f"FP8 {self.fp8_fmt} (per channel)",
                "int4_pack": "pack-quantized INT4", "int8_pack": "pack-quantized INT8", "int8": "int-quantized INT8",
                "groups": "compressed-tensors config groups", "none": "no quantization"}[self.method]

    def for_module(self, module: str) -> QuantScheme:
        """The scheme of HF module `module` (e.g. model.layers.0.self_attn.q_a_proj): its config group's."""
        if self.method != "groups":
            return self
        if _targets(self.ignore, module) is not None:
            return QuantScheme("none")
        ranked = [(rank, g) for g in self.groups if (rank := _targets(g.targets, module)) is not None]
        return min(ranked, key=lambda x: x[0])[1].scheme if ranked else QuantScheme("none")

    def check_stored(self, name: str, stored: str) -> None:
        """Refuse a tensor of a quantized linear whose stored dtype disagrees with what config.json declares."""
        if self.method == "none":
            return  # an unquantized config: FP8 tensors are still read if they carry their scales
        if name.endswith(".weight_packed"):
            want: tuple[str, ...] = ("I32",)
        elif name.endswith(".weight"):  # called for FP8- and I8-stored weights only
            want = {"int4_pack": FLOAT_STORED, "int8_pack": FLOAT_STORED, "int8": ("I8",)}.get(
                self.method, (FP8_STORED[self.fp8_fmt],))
        else:  # weight_scale / weight_scale_inv
            want = FLOAT_STORED
        if stored not in want:
            raise CheckpointError(f"tensor {name!r} is stored as {stored}, but config.json declares "
                                  f"{self.declared()} (expected {' or '.join(want)})", value=stored, param=name)


def _targets(targets: tuple[str, ...], module: str) -> int | None:
    """How well `targets` name `module`: 0 an exact name, 1 a `re:` regex (matched from the start, as
    compressed-tensors does), 2 the class name Linear; None if none does. `module` may carry the `language_model.`
    prefix or not."""
    names = (module, module.removeprefix("language_model."), "language_model." + module)
    best = None
    for t in targets:
        if t in names:
            rank = 0
        elif t.startswith("re:") and any(re.match(t[3:], n) for n in names):
            rank = 1
        elif t == "Linear":
            rank = 2
        else:
            continue
        best = rank if best is None else min(best, rank)
    return best


def _ct_group(name: str, group: dict, fmt: str | None) -> WeightGroup:
    """One compressed-tensors config group -> WeightGroup. Raises ConfigError for what is not supported."""
    param = f"quantization_config.config_groups.{name}"
    w = group.get("weights") or {}
    fmt = group.get("format") or fmt
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy", "group")
    if not w.get("symmetric", True):
        raise ConfigError(f"{name}: only symmetric weights are supported", value=w, param=param)
    if strategy not in ("group", "channel"):
        raise ConfigError(f"{name}: weight strategy {strategy!r} is not supported (group, channel)", value=w,
                          param=param)
    group_size = int(w.get("group_size") or 32) if strategy == "group" else None
    if fmt == "pack-quantized" and kind == "int" and bits in (4, 8):
        scheme = QuantScheme(f"int{bits}_pack", group_size=group_size)
    elif fmt == "int-quantized" and kind == "int" and bits == 8:
        scheme = QuantScheme("int8", group_size=group_size)
    elif fmt == "float-quantized" and kind == "float" and bits == 8:
        scheme = QuantScheme("fp8_channel")
    else:
        raise ConfigError(f"{name}: unsupported compressed-tensors group ({fmt}, {bits}-bit {kind}); supported: "
                          "pack-quantized 4/8-bit int, int-quantized 8-bit int, float-quantized 8-bit float",
                          value=w, param=param)
    targets = group.get("targets") or ["Linear"]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise ConfigError(f"{name}: targets must be a list of strings", value=targets, param=param + ".targets")
    return WeightGroup(name, tuple(targets), scheme)


def quant_scheme(raw: dict) -> QuantScheme:
    q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not q:
        return QuantScheme("none")
    method = q.get("quant_method")
    if method == "fp8":
        fmt = q.get("fmt", "e4m3")
        if fmt not in FP8_STORED:
            raise ConfigError(f"unsupported FP8 fmt {fmt!r}; supported: {', '.join(FP8_STORED)}", value=fmt,
                              param="quantization_config.fmt")
        return QuantScheme("fp8_block", block=tuple(q.get("weight_block_size") or (128, 128)), fp8_fmt=fmt)
    if method == "compressed-tensors":
        fmt = q.get("format")
        raw_groups = q.get("config_groups") or {}
        if not raw_groups:
            if fmt == "float-quantized":
                return QuantScheme("fp8_channel")
            raise ConfigError("compressed-tensors config without config_groups", value=q,
                              param="quantization_config.config_groups")
        groups = tuple(_ct_group(name, g, fmt) for name, g in raw_groups.items())
        ignore = tuple(q.get("ignore") or ())
        if len(groups) == 1 and groups[0].targets == ("Linear",):
            return groups[0].scheme  # one group for every linear (ignored ones are stored plain)
        return QuantScheme("groups", groups=groups, ignore=ignore)
    raise ConfigError(f"unsupported quant_method {method!r}; supported: fp8, compressed-tensors", value=method,
                      param="quantization_config.quant_method")


class HFReader:
    """Reads HF tensors by name, dequantizing linears, with the `language_model.` prefix of Kimi K2.5/2.6 handled."""

    def __init__(self, folder: SafetensorsFolder, scheme: QuantScheme) -> None:
        self.st = folder
        self.scheme = scheme
        self.prefix = "language_model." if any(n.startswith("language_model.") for n in folder.tensors) else ""

    def has(self, name: str) -> bool:
        return self.prefix + name in self.st

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        full = self.prefix + name
        a = self.st.read(full)
        if tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"tensor {full!r} has shape {tuple(a.shape)}, expected {tuple(shape)}",
                                  value=tuple(a.shape), param=full)
        return a.astype(np.float32)

    def linear(self, module: str, out_dim: int, in_dim: int) -> np.ndarray:
        """The [out, in] weight of HF module `module` (e.g. model.layers.0.self_attn.q_a_proj), dequantized f32."""
        p = self.prefix + module
        scheme = self.scheme.for_module(p)
        if p + ".weight_packed" in self.st:
            if scheme.method not in ("int4_pack", "int8_pack"):
                raise CheckpointError(f"{p}.weight_packed is packed, but config.json gives {p} "
                                      f"{scheme.declared()}", value=scheme.method, param=p + ".weight_packed")
            shape_name = p + ".weight_shape"
            shape = tuple(int(v) for v in self.st.read(shape_name)) if shape_name in self.st else (out_dim, in_dim)
            self._expect(shape_name, shape, (out_dim, in_dim))
            scheme.check_stored(p + ".weight_packed", self.st.info(p + ".weight_packed").dtype)
            packed, scale = self.st.read(p + ".weight_packed"), self.st.read(p + ".weight_scale")
            try:
                return hf_formats.dequantize_pack_quantized(packed, scale.reshape(out_dim, -1), shape,
                                                            scheme.group_size, scheme.num_bits)
            except ValueError as e:
                raise CheckpointError(f"{p}: {e}", value=(packed.shape, scale.shape), param=p) from e
        w_name = p + ".weight"
        info = self.st.info(w_name)  # raises a CheckpointError naming the missing tensor
        self._expect(w_name, info.shape, (out_dim, in_dim))
        w = self.st.read(w_name)
        if info.dtype == "I8":
            scheme.check_stored(w_name, info.dtype)
            if scheme.method != "int8" or p + ".weight_scale" not in self.st:
                raise CheckpointError(f"{w_name} is INT8 but config.json gives {p} {scheme.declared()} (an "
                                      "int-quantized group with weight_scale is needed)", value=info.dtype, param=w_name)
            scale = self.st.read(p + ".weight_scale")
            scheme.check_stored(p + ".weight_scale", self.st.info(p + ".weight_scale").dtype)
            try:
                return hf_formats.dequantize_int(w, scale.reshape(out_dim, -1), scheme.group_size)
            except ValueError as e:
                raise CheckpointError(f"{p}: {e}", value=scale.shape, param=p + ".weight_scale") from e
        if info.dtype in FP8_STORED.values():
            scheme.check_stored(w_name, info.dtype)
            if p + ".weight_scale_inv" in self.st:
                scheme.check_stored(p + ".weight_scale_inv", self.st.info(p + ".weight_scale_inv").dtype)
                try:
                    return hf_formats.dequantize_fp8_block(w, self.st.read(p + ".weight_scale_inv"), scheme.block)
                except ValueError as e:
                    raise CheckpointError(f"{p}.weight_scale_inv: {e}", value=info.shape, param=p) from e
            if p + ".weight_scale" in self.st:
                scheme.check_stored(p + ".weight_scale", self.st.info(p + ".weight_scale").dtype)
                s = self.st.read(p + ".weight_scale").astype(np.float32).reshape(-1)
                if s.size not in (1, out_dim):
                    raise CheckpointError(f"{p}.weight_scale has {s.size} values, expected 1 or {out_dim}",
                                          value=s.size, param=p + ".weight_scale")
                return w.astype(np.float32) * (s[:, None] if s.size == out_dim else s)
            raise CheckpointError(f"tensor {p}.weight is FP8 but neither {p}.weight_scale_inv nor "
                                  f"{p}.weight_scale is present", value=info.dtype, param=p + ".weight_scale_inv")
        return w.astype(np.float32)

    def optional_vector(self, name: str, dim: int) -> np.ndarray | None:
        return self.tensor(name, (dim,)) if self.has(name) else None

    @staticmethod
    def _expect(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
        if tuple(got) != tuple(want):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}", value=tuple(got),
                                  param=name)


def _rope_rows(n_heads: int, head_dim: int, rope_start: int, rope_dim: int) -> np.ndarray:
    """Row order for a per-head projection whose rope slice is interleaved -> half-split."""
    perm = interleave_to_half_split(rope_dim)
    rows = []
    for h in range(n_heads):
        base = np.arange(head_dim) + h * head_dim
        head = base.copy()
        head[rope_start:rope_start + rope_dim] = base[rope_start:rope_start + rope_dim][perm]
        rows.append(head)
    return np.concatenate(rows)


class _Linears:
    """Reads one checkpoint's linear, norm and MLP tensors into jaxserve's layout (weights [in, out])."""

    def __init__(self, r: HFReader, hidden: int) -> None:
        self.r, self.hidden = r, hidden

    def lin(self, module: str, out_dim: int, in_dim: int, rows: np.ndarray | None = None, bias: bool = False) -> dict:
        w = self.r.linear(module, out_dim, in_dim)
        if rows is not None:
            w = w[rows]
        d = {"weight": w.T}
        if bias:
            b = self.r.tensor(module + ".bias", (out_dim,))
            d["bias"] = b[rows] if rows is not None else b
        return d

    def norm(self, name: str, dim: int, rows: np.ndarray | None = None) -> dict:
        w = self.r.tensor(name + ".weight", (dim,))
        return {"weight": w[rows] if rows is not None else w}

    def mlp(self, prefix: str, inter: int) -> dict:
        H = self.hidden
        return {"gate": self.lin(f"{prefix}.gate_proj", inter, H), "up": self.lin(f"{prefix}.up_proj", inter, H),
                "down": self.lin(f"{prefix}.down_proj", H, inter)}


def _mla_params(cfg: ModelConfig, t: _Linears, A: str, i: int) -> dict:
    """Layer i's MLA attention (and GLM-5's DSA indexer where the layer computes its own top-k)."""
    H, N = cfg.hidden_size, cfg.num_heads
    r_, dr, dn, dv, qk = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim
    q_rows = _rope_rows(N, qk, dn, dr) if cfg.rope_interleave else None
    kv_rows = _rope_rows(1, r_ + dr, r_, dr) if cfg.rope_interleave else None
    bias = cfg.attention_bias
    attn: dict = {}
    if cfg.q_lora_rank:
        attn["q_a"] = t.lin(f"{A}.q_a_proj", cfg.q_lora_rank, H, bias=bias)
        attn["q_a_norm"] = t.norm(f"{A}.q_a_layernorm", cfg.q_lora_rank)
        attn["q_b"] = t.lin(f"{A}.q_b_proj", N * qk, cfg.q_lora_rank, rows=q_rows)
    else:
        attn["q_proj"] = t.lin(f"{A}.q_proj", N * qk, H, rows=q_rows)
    attn["kv_a"] = t.lin(f"{A}.kv_a_proj_with_mqa", r_ + dr, H, rows=kv_rows, bias=bias)
    attn["kv_a_norm"] = t.norm(f"{A}.kv_a_layernorm", r_)
    attn["kv_b"] = t.lin(f"{A}.kv_b_proj", N * (dn + dv), r_)
    attn["o"] = t.lin(f"{A}.o_proj", H, N * dv, bias=bias)
    if cfg.full_indexer(i):
        nh, hd = cfg.index_n_heads, cfg.index_head_dim
        irows = _rope_rows(nh, hd, 0, dr) if cfg.indexer_rope_interleave else None
        krows = _rope_rows(1, hd, 0, dr) if cfg.indexer_rope_interleave else None
        I = f"{A}.indexer"
        kn = {"weight": t.r.tensor(f"{I}.k_norm.weight", (hd,)), "bias": t.r.tensor(f"{I}.k_norm.bias", (hd,))}
        if krows is not None:
            kn = {k: v[krows] for k, v in kn.items()}
        attn["indexer"] = {
            "wq_b": t.lin(f"{I}.wq_b", nh * hd, cfg.q_lora_rank, rows=irows),
            "wk": t.lin(f"{I}.wk", hd, H, rows=krows),
            "k_norm": kn,
            "weights_proj": t.lin(f"{I}.weights_proj", nh, H),
        }
    return attn


def _gqa_params(cfg: ModelConfig, t: _Linears, A: str) -> dict:
    """GQA attention (GLM-4.5): q/k/v/o projections, optional per-head q/k norms."""
    H, N, D, K, b = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads, cfg.attention_bias
    attn = {"q": t.lin(f"{A}.q_proj", N * D, H, bias=b), "k": t.lin(f"{A}.k_proj", K * D, H, bias=b),
            "v": t.lin(f"{A}.v_proj", K * D, H, bias=b), "o": t.lin(f"{A}.o_proj", H, N * D)}
    if cfg.use_qk_norm:
        attn["q_norm"] = t.norm(f"{A}.q_norm", D)
        attn["k_norm"] = t.norm(f"{A}.k_norm", D)
    return attn


def _moe_params(cfg: ModelConfig, t: _Linears, M: str) -> dict:
    """A sparse layer's router, routed experts stacked [E, in, out] and shared experts."""
    r, H, E, I_ = t.r, cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    moe: dict = {
        "router": r.tensor(f"{M}.gate.weight", (E, H)).T,
        "router_bias": r.optional_vector(f"{M}.gate.e_score_correction_bias", E),
    }
    if moe["router_bias"] is None:
        moe["router_bias"] = np.zeros((E,), np.float32)
    if r.has(f"{M}.experts.gate_up_proj"):  # transformers' fused in-memory layout [E, 2I, H]
        gu = r.tensor(f"{M}.experts.gate_up_proj", (E, 2 * I_, H))
        moe["experts"] = {"gate": gu[:, :I_].transpose(0, 2, 1), "up": gu[:, I_:].transpose(0, 2, 1),
                          "down": r.tensor(f"{M}.experts.down_proj", (E, H, I_)).transpose(0, 2, 1)}
    else:
        moe["experts"] = {
            name: np.stack([r.linear(f"{M}.experts.{e}.{name}_proj", o, n).T for e in range(E)])
            for name, o, n in (("gate", I_, H), ("up", I_, H), ("down", H, I_))
        }
    if cfg.n_shared_experts:
        moe["shared"] = t.mlp(f"{M}.shared_experts", I_ * cfg.n_shared_experts)
    return moe


def _layer_params(cfg: ModelConfig, r: HFReader, i: int) -> dict:
    """The jaxserve pure-dict params of layer i (weights [in, out], experts stacked [E, in, out])."""
    t = _Linears(r, cfg.hidden_size)
    L = f"model.layers.{i}"
    A, M = f"{L}.self_attn", f"{L}.mlp"
    return {
        "input_norm": t.norm(f"{L}.input_layernorm", cfg.hidden_size),
        "post_norm": t.norm(f"{L}.post_attention_layernorm", cfg.hidden_size),
        "attn": _mla_params(cfg, t, A, i) if cfg.is_mla else _gqa_params(cfg, t, A),
        "mlp": t.mlp(M, cfg.intermediate_size) if cfg.mlp_type(i) == "dense" else _moe_params(cfg, t, M),
    }


def _mtp_params(cfg: ModelConfig, r: HFReader) -> dict:
    """The MTP head (layer num_hidden_layers): enorm, hnorm, eh_proj [2H, H], its decoder layer, shared_head.norm.
    Its embed_tokens / shared_head.head copies, where a checkpoint has them, are not read (the main ones are used)."""
    t, N, H = _Linears(r, cfg.hidden_size), cfg.num_layers, cfg.hidden_size
    L = f"model.layers.{N}"
    return {"enorm": t.norm(f"{L}.enorm", H), "hnorm": t.norm(f"{L}.hnorm", H),
            "eh_proj": t.lin(f"{L}.eh_proj", H, 2 * H), "layer": _layer_params(cfg, r, N),
            "norm": t.norm(f"{L}.shared_head.norm", H)}


def has_mtp(cfg: ModelConfig, r: HFReader) -> bool:
    """Whether the checkpoint holds the MTP head its config declares (many conversions drop it)."""
    return bool(cfg.mtp_layers) and r.has(f"model.layers.{cfg.num_layers}.eh_proj.weight")


def _top_params(cfg: ModelConfig, r: HFReader) -> dict:
    out = {"embed": r.tensor("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
           "norm": {"weight": r.tensor("model.norm.weight", (cfg.hidden_size,))}}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = {"weight": r.linear("lm_head", cfg.vocab_size, cfg.hidden_size).T}
    return out


def _cast(tree: dict, dtype: np.dtype, keep_f32: Callable[[str], bool], path: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        p = f"{path}.{k}" if path else k
        out[k] = _cast(v, dtype, keep_f32, p) if isinstance(v, dict) else \
            np.ascontiguousarray(v.astype(np.float32 if keep_f32(p) else dtype))
    return out


def _keep_f32(path: str) -> bool:
    # Router, its bias and the DSA weights_proj stay f32 (as HF keeps them): routing is rounding-sensitive.
    return path.endswith(("router", "router_bias")) or "weights_proj" in path


def convert(hf_dir: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16", progress: bool = True) -> Path:
    """Convert an HF folder to a jaxserve checkpoint; returns OUT_DIR. Raises CheckpointError / ConfigError."""
    from jaxserve.checkpoint import group_names, partial_output, save_group  # the Orbax layout lives with the loader

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_NAMES)}", value=dtype,
                          param="dtype")
    if out_dir.exists():
        raise CheckpointError(f"output folder {out_dir} already exists", value=str(out_dir), param="out_dir")
    raw = json.loads((hf_dir / "config.json").read_text()) if (hf_dir / "config.json").exists() else None
    if raw is None:
        raise CheckpointError(f"no config.json in {hf_dir}", value=str(hf_dir), param="config.json")
    cfg = from_hf_config(raw)
    reader = HFReader(SafetensorsFolder(hf_dir), quant_scheme(raw))
    if not has_mtp(cfg, reader):
        cfg = replace(cfg, mtp_layers=0)
    np_dtype = np.dtype(DTYPE_NAMES[dtype])
    with partial_output(out_dir) as partial:
        (partial / "params").mkdir()
        groups = group_names(cfg)
        for g in tqdm(groups, desc=f"convert {hf_dir.name}", unit="group", disable=not progress):
            tree = (_top_params(cfg, reader) if g == "embed" else _mtp_params(cfg, reader) if g == "mtp"
                    else _layer_params(cfg, reader, int(g[6:])))
            save_group(partial / "params" / g, _cast(tree, np_dtype, _keep_f32))
        for name in TOKENIZER_FILES:
            if (hf_dir / name).exists():
                shutil.copy2(hf_dir / name, partial / name)
        shutil.copy2(hf_dir / "config.json", partial / "config.json")
        manifest = {"format": "jaxserve-orbax-v1", "dtype": dtype, "model": cfg.to_dict(),
                    "source": {"path": str(hf_dir), "quantization": reader.scheme.method},
                    "groups": groups}
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out_dir


def add_arguments(p) -> None:  # noqa: ANN001 - argparse.ArgumentParser
    p.add_argument("hf_dir", help="HF folder: config.json + safetensors shards")
    p.add_argument("out_dir", help="output folder (must not exist)")
    p.add_argument("--dtype", default="bfloat16", type=lambda s: DTYPE_ALIASES.get(s, s), choices=sorted(DTYPE_NAMES),
                   help="bfloat16 (bf16) or float32 (f32, fp32)")


def run(args) -> int:  # noqa: ANN001 - argparse.Namespace
    print(f"wrote {convert(args.hf_dir, args.out_dir, dtype=args.dtype)}")
    return 0
