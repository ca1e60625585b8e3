"""The HF -> Orbax converter on real safetensors files: FP8 block-scaled and INT4 pack-quantized layouts, errors."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_tiny
import jaxserve
from jaxserve.convert.converter import convert
from jaxserve.checkpoint import model_params
from jaxserve.errors import CheckpointError, ConfigError
from jaxserve.quant import hf_formats

NOT_QUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "e_score_correction_bias")


@pytest.fixture(scope="module")
def kimi_hf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("kimi") / "hf"
    hf_tiny.save(hf_tiny.build("deepseek_v3"), folder)
    return folder, {k: v.numpy() for k, v in load_file(folder / "model.safetensors").items()}


def _write(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _quantized_linear_names(state: dict[str, np.ndarray], only_experts: bool) -> list[str]:
    names = [k for k in state if k.endswith(".weight") and state[k].ndim == 2 and not any(s in k for s in NOT_QUANTIZED)]
    return [k for k in names if ".mlp.experts." in k] if only_experts else names


def _converted_param(params: dict[str, np.ndarray], hf_name: str) -> np.ndarray:
    """The jaxserve parameter holding HF linear `hf_name`, back in HF [out, in] layout (experts unstacked)."""
    parts = hf_name.removeprefix("language_model.").split(".")
    layer = parts[2]
    if parts[4] == "experts":
        e, proj = int(parts[5]), parts[6].removesuffix("_proj")
        return params[f"layers.{layer}.mlp.experts.{proj}"][e].T
    mapping = {"q_a_proj": "attn.q_a", "q_b_proj": "attn.q_b", "kv_a_proj_with_mqa": "attn.kv_a",
               "kv_b_proj": "attn.kv_b", "o_proj": "attn.o", "gate_proj": "gate", "up_proj": "up",
               "down_proj": "down"}
    module = parts[-2]
    prefix = ".".join(parts[3:-2])  # self_attn | mlp | mlp.shared_experts
    if prefix == "self_attn":
        return params[f"layers.{layer}.{mapping[module]}.weight"].T
    sub = "mlp.shared" if prefix == "mlp.shared_experts" else "mlp"
    return params[f"layers.{layer}.{sub}.{mapping[module]}.weight"].T


def _unpermute_rope(cfg, hf_name: str, w: np.ndarray) -> np.ndarray:
    """Undo the converter's interleaved -> half-split row permutation (q_b rope rows, kv_a rope rows)."""
    from jaxserve.convert.converter import _rope_rows

    if "q_b_proj" in hf_name:
        rows = _rope_rows(cfg.num_heads, cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim)
    elif "kv_a_proj_with_mqa" in hf_name:
        rows = _rope_rows(1, cfg.latent_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    else:
        return w
    out = np.empty_like(w)
    out[rows] = w
    return out


def test_fp8_block_scaled_checkpoint(kimi_hf, tmp_path):
    """DeepSeek/Kimi FP8: e4m3 weights + weight_scale_inv per block (16x16 here: several tiles, partial edges)."""
    folder, state = kimi_hf
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    tensors, scales = {}, {}
    for k, v in state.items():
        tensors[k] = torch.from_numpy(v)
    for k in _quantized_linear_names(state, only_experts=False):
        q, s = hf_formats.quantize_fp8_block(state[k], (16, 16))
        tensors[k] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        tensors[k.removesuffix("weight") + "weight_scale_inv"] = torch.from_numpy(s)
        scales[k] = s
    assert any(s.shape[0] * 16 != state[k].shape[0] for k, s in scales.items())  # a partial edge tile exists
    _write(tmp_path / "fp8", tensors, config)
    convert(tmp_path / "fp8", tmp_path / "out", dtype="float32", progress=False)
    cfg, model = jaxserve.load(tmp_path / "out")
    params = model_params(model)
    for k, s in scales.items():
        got = _unpermute_rope(cfg, k, _converted_param(params, k))
        src = state[k]
        per_elem_scale = np.repeat(np.repeat(s, 16, 0), 16, 1)[: src.shape[0], : src.shape[1]]
        # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative for normals; subnormal spacing 2^-9 (half 2^-10) x scale.
        bound = np.maximum(np.abs(src) * 2.0**-4, per_elem_scale * 2.0**-10) * 1.0001
        assert np.all(np.abs(got - src) <= bound), k
        exact = hf_formats.dequantize_fp8_block(tensors[k].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), s,
                                                (16, 16))
        np.testing.assert_array_equal(got, exact)


def test_int4_pack_quantized_checkpoint(kimi_hf, tmp_path):
    """Kimi K2.5/K2.6 layout: routed experts INT4 pack-quantized (group 32), the rest BF16-style plain,
    `language_model.` prefix and a kimi_k25 config with the text model in text_config."""
    folder, state = kimi_hf
    text_config = json.loads((folder / "config.json").read_text())
    group = 32
    text_config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}
    config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "text_config": text_config, "vision_config": {"vt_hidden_size": 8}}
    tensors: dict[str, torch.Tensor] = {"vision_tower.patch_embed.proj.weight": torch.zeros(2, 3)}
    written = {}
    for k, v in state.items():
        tensors["language_model." + k] = torch.from_numpy(v)
    for k in _quantized_linear_names(state, only_experts=True):
        q, s = hf_formats.quantize_int4_group(state[k], group)
        s_bf16 = torch.from_numpy(s).to(torch.bfloat16)
        base = "language_model." + k.removesuffix("weight")
        del tensors["language_model." + k]
        tensors[base + "weight_packed"] = torch.from_numpy(hf_formats.pack_int4(q))
        tensors[base + "weight_scale"] = s_bf16
        tensors[base + "weight_shape"] = torch.tensor(state[k].shape, dtype=torch.int32)
        written[k] = (q, s_bf16.float().numpy())
    _write(tmp_path / "int4", tensors, config)
    convert(tmp_path / "int4", tmp_path / "out", dtype="float32", progress=False)
    cfg, model = jaxserve.load(tmp_path / "out")
    assert cfg.model_type == "deepseek_v3"
    params = model_params(model)
    for k, (q, s) in written.items():
        got = _converted_param(params, k)
        np.testing.assert_array_equal(got, hf_formats.dequantize_int4_group(q, s, group))
        s_elem = np.repeat(s, group, 1)[:, : state[k].shape[1]]
        # Round to nearest: half a step, plus what the bf16 rounding of the scale moves (8 steps x 2^-9 relative).
        assert np.all(np.abs(got - state[k]) <= s_elem * (0.5 + 8 * 2.0**-8) + 1e-7), k


def _break(kimi_hf, tmp_path: Path, edit) -> Path:
    folder, state = kimi_hf
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    config = json.loads((folder / "config.json").read_text())
    edit(tensors, config)
    return _write(tmp_path / "bad", tensors, config)


def _assert_nothing_left(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "out.partial").exists()


def test_missing_tensor_is_named(kimi_hf, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    bad = _break(kimi_hf, tmp_path, lambda t, c: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as e:
        convert(bad, tmp_path / "out", progress=False)
    assert e.value.value == name
    _assert_nothing_left(tmp_path)


def test_wrong_shape_names_tensor_and_expected(kimi_hf, tmp_path):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    bad = _break(kimi_hf, tmp_path, lambda t, c: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight.*\(128, 15\).*expected \(128, 16\)"):
        convert(bad, tmp_path / "out", progress=False)
    _assert_nothing_left(tmp_path)


def test_fp8_weight_without_scale(kimi_hf, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    bad = _break(kimi_hf, tmp_path, lambda t, c: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    with pytest.raises(CheckpointError, match=r"o_proj\.weight_scale_inv"):
        convert(bad, tmp_path / "out", progress=False)
    _assert_nothing_left(tmp_path)


def test_unreadable_dtype_is_named(kimi_hf, tmp_path):
    folder, state = kimi_hf
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    header, blobs, offset = {}, [], 0
    for k, v in state.items():
        raw = np.ascontiguousarray(v).tobytes()
        dtype = "C64" if k == "model.norm.weight" else "F32"
        header[k] = {"dtype": dtype, "shape": list(v.shape) if dtype == "F32" else [v.shape[0] // 2],
                     "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*C64"):
        convert(bad, tmp_path / "out", progress=False)
    _assert_nothing_left(tmp_path)


def test_unknown_model_type_lists_supported(kimi_hf, tmp_path):
    bad = _break(kimi_hf, tmp_path, lambda t, c: c.__setitem__("model_type", "llama"))
    with pytest.raises(ConfigError, match="deepseek_v3.*glm4_moe.*glm_moe_dsa") as e:
        convert(bad, tmp_path / "out", progress=False)
    assert e.value.value == "llama"
    _assert_nothing_left(tmp_path)


def test_existing_output_is_refused(kimi_hf, tmp_path):
    folder, _ = kimi_hf
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        convert(folder, tmp_path / "out", progress=False)


def test_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "params").mkdir()
    with pytest.raises(CheckpointError, match="not a complete jaxserve checkpoint"):
        jaxserve.load(tmp_path)


def _fp8_block_checkpoint(kimi_hf, tmp_path: Path, stored_as: dict[str, torch.dtype], fmt: str = "e4m3") -> Path:
    """The FP8 block-scaled layout (16x16 tiles), with the tensors in `stored_as` written in another dtype."""
    folder, state = kimi_hf
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": fmt, "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    for k in _quantized_linear_names(state, only_experts=False):
        q, s = hf_formats.quantize_fp8_block(state[k], (16, 16))
        tensors[k] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        tensors[k.removesuffix("weight") + "weight_scale_inv"] = torch.from_numpy(s)
    for k, dt in stored_as.items():
        tensors[k] = tensors[k].float().to(dt)
    return _write(tmp_path / "fp8", tensors, config)


def test_fp8_tensor_stored_in_another_format_is_named(kimi_hf, tmp_path):
    """Issue 12.7: an F8_E5M2 tensor under `"fmt": "e4m3"` is refused (reading it as e4m3 would be silent garbage)."""
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    bad = _fp8_block_checkpoint(kimi_hf, tmp_path, {name: torch.float8_e5m2})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*F8_E5M2.*e4m3.*F8_E4M3") as e:
        convert(bad, tmp_path / "out", progress=False)
    assert e.value.param == name and e.value.value == "F8_E5M2"
    _assert_nothing_left(tmp_path)


def test_fp8_scale_stored_as_fp8_is_named(kimi_hf, tmp_path):
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    bad = _fp8_block_checkpoint(kimi_hf, tmp_path, {name: torch.float8_e4m3fn})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*F8_E4M3") as e:
        convert(bad, tmp_path / "out", progress=False)
    assert e.value.param == name
    _assert_nothing_left(tmp_path)


def test_unknown_fp8_fmt_is_refused(kimi_hf, tmp_path):
    bad = _fp8_block_checkpoint(kimi_hf, tmp_path, {}, fmt="e3m4")
    with pytest.raises(ConfigError, match="e3m4") as e:
        convert(bad, tmp_path / "out", progress=False)
    assert e.value.param == "quantization_config.fmt"
    _assert_nothing_left(tmp_path)


def test_int4_packed_weight_in_wrong_dtype_is_named(kimi_hf, tmp_path):
    folder, state = kimi_hf
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    target = _quantized_linear_names(state, only_experts=True)[0]
    for k in _quantized_linear_names(state, only_experts=True):
        q, s = hf_formats.quantize_int4_group(state[k], 32)
        base = k.removesuffix("weight")
        del tensors[k]
        packed = torch.from_numpy(hf_formats.pack_int4(q))
        tensors[base + "weight_packed"] = packed.to(torch.int64) if k == target else packed
        tensors[base + "weight_scale"] = torch.from_numpy(s).to(torch.bfloat16)
        tensors[base + "weight_shape"] = torch.tensor(state[k].shape, dtype=torch.int32)
    bad = _write(tmp_path / "int4", tensors, config)
    name = target.removesuffix("weight") + "weight_packed"
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*I64.*INT4.*I32") as e:
        convert(bad, tmp_path / "out", progress=False)
    assert e.value.param == name
    _assert_nothing_left(tmp_path)


def test_compressed_tensors_groups_are_read_by_their_targets(kimi_hf, tmp_path):
    """Several config_groups, as third-party GLM-5.x quantizations ship: INT8 attention (int-quantized, one scale per
    output channel) + INT4 routed experts (pack-quantized, group 32), everything else plain; `ignore` wins over a
    target; group-level formats under a mixed-precision config; a dtype alias ("f32") for the output."""
    folder, state = kimi_hf
    config = json.loads((folder / "config.json").read_text())
    group = 32
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mixed-precision",
        "config_groups": {
            "attn": {"targets": ["re:.*self_attn\\.(q_a|q_b|kv_b|o)_proj$"], "format": "int-quantized",
                     "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}},
            "experts": {"targets": ["re:.*mlp\\.experts\\..*"], "format": "pack-quantized",
                        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                    "group_size": group}}},
        "ignore": ["lm_head", "re:.*layers\\.0\\.self_attn\\.o_proj$"]}
    tensors = {k: torch.from_numpy(v) for k, v in state.items()}
    int8, int4 = {}, {}
    for k in _quantized_linear_names(state, only_experts=False):
        base = k.removesuffix("weight")
        w = state[k]
        if ".mlp.experts." in k:
            q, s = hf_formats.quantize_int4_group(w, group)
            del tensors[k]
            tensors[base + "weight_packed"] = torch.from_numpy(hf_formats.pack_int4(q))
            tensors[base + "weight_scale"] = torch.from_numpy(s)
            tensors[base + "weight_shape"] = torch.tensor(w.shape, dtype=torch.int32)
            int4[k] = (q, s)
        elif any(f"self_attn.{m}_proj" in k for m in ("q_a", "q_b", "kv_b", "o")) and "layers.0.self_attn.o_proj" not in k:
            s = np.maximum(np.abs(w).max(axis=1, keepdims=True) / 127, 1e-8).astype(np.float32)
            q = np.clip(np.rint(w / s), -128, 127).astype(np.int8)
            tensors[k] = torch.from_numpy(q)
            tensors[base + "weight_scale"] = torch.from_numpy(s)
            int8[k] = (q, s)
    assert int8 and int4
    _write(tmp_path / "mixed", tensors, config)
    convert(tmp_path / "mixed", tmp_path / "out", dtype="f32", progress=False)
    cfg, model = jaxserve.load(tmp_path / "out")
    params = model_params(model)
    for k, (q, s) in int8.items():
        got = _unpermute_rope(cfg, k, _converted_param(params, k))
        np.testing.assert_array_equal(got, q.astype(np.float32) * s)
    for k, (q, s) in int4.items():
        np.testing.assert_array_equal(_converted_param(params, k), hf_formats.dequantize_int4_group(q, s, group))
    ignored = "model.layers.0.self_attn.o_proj.weight"  # listed in `ignore`: stored plain and read plain
    np.testing.assert_array_equal(_converted_param(params, ignored), state[ignored])


def test_int8_weight_outside_an_int8_group_is_named(kimi_hf, tmp_path):
    name = "model.layers.0.self_attn.o_proj"

    def edit(tensors, config):  # noqa: ANN001
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                         "config_groups": {"g": {"targets": ["re:.*experts.*"], "weights": {
                                             "num_bits": 4, "type": "int", "symmetric": True, "group_size": 32}}}}
        tensors[name + ".weight"] = tensors[name + ".weight"].to(torch.int8)
        tensors[name + ".weight_scale"] = torch.ones(tensors[name + ".weight"].shape[0], 1)

    with pytest.raises(CheckpointError) as e:
        convert(_break(kimi_hf, tmp_path, edit), tmp_path / "out", progress=False)
    assert e.value.param == name + ".weight" and "no quantization" in e.value.message
    _assert_nothing_left(tmp_path)


def test_pack_int8_round_trips():
    q = np.random.default_rng(0).integers(-128, 128, (5, 13)).astype(np.int8)
    np.testing.assert_array_equal(hf_formats.unpack_int8(hf_formats.pack_int8(q), 13), q)


def test_dtype_aliases_name_formats_everywhere(kimi_hf, tmp_path, capsys):
    """Engine config and flags, `jaxserve plan`, `jaxserve quantize` (+ loading its output), KV layouts: each takes
    "bfloat16" / "float8_e4m3fn" / "uint4" for a format, and a name that is no format fails typed, naming it."""
    import argparse

    from jaxserve.cache import KVLayout
    from jaxserve.checkpoint import load, load_formats
    from jaxserve.cli import main
    from jaxserve.engine import EngineConfig
    from jaxserve.engine.generate import add_arguments
    from jaxserve.plan import PlanSpec
    from jaxserve.quant.checkpoint import QuantizeSpec

    cfg = EngineConfig(kv_dtype="float8_e4m3fn", prefill_weights="bfloat16", decode_weights="float32", dtype="bf16",
                       index_kv_dtype="bfloat16")
    assert (cfg.kv_dtype, cfg.prefill_weights, cfg.decode_weights, cfg.dtype) == ("fp8", "bf16", "f32", "bfloat16")
    assert cfg.index_kv_dtype == "bf16"
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--prompt", "x", "--kv-dtype", "bfloat16", "--prefill-weights", "float8_e4m3fn"])
    assert (args.kv_dtype, args.prefill_weights) == ("bf16", "fp8")
    with pytest.raises(ConfigError):
        EngineConfig(kv_dtype="float16")

    layout = KVLayout.mla(2, 8, 4, dtype="float8_e4m3fn", index_layers=1, index_head_dim=8, index_dtype="bfloat16")
    assert (layout.dtype, layout.index_dtype, layout.jnp_dtype) == ("fp8", "bf16", np.dtype(ml_dtypes.float8_e4m3fn))
    with pytest.raises(ConfigError) as e:
        KVLayout.gqa(2, 2, 8, dtype="float16")
    assert (e.value.value, e.value.param) == ("float16", "dtype")

    # jaxserve plan, weights and KV only, on one device
    plan_args = ["plan", "--config", str(kimi_hf[0] / "config.json"), "--devices", "1", "--no-compile", "--json",
                 "--no-progress"]
    capsys.readouterr()
    assert main([*plan_args, "--kv-dtype", "float8_e4m3fn", "--decode-weights", "float8_e4m3fn",
                 "--prefill-weights", "bfloat16"]) == 0
    spec = json.loads(capsys.readouterr().out)["spec"]
    assert (spec["kv_dtype"], spec["decode_weights"], spec["prefill_weights"]) == ("fp8", "fp8", "bf16")
    assert main([*plan_args, "--kv-dtype", "float16"]) == 2
    assert "'float16'" in capsys.readouterr().err
    with pytest.raises(ConfigError) as e:
        PlanSpec(decode_weights="int8")
    assert (e.value.value, e.value.param) == ("int8", "decode_weights")

    # jaxserve quantize, then its FP8 weights loaded by their dtype name
    src = convert(kimi_hf[0], tmp_path / "bf16", progress=False)
    assert main(["quantize", str(src), str(tmp_path / "q"), "--weights", "float8_e4m3fn", "--prefill-weights",
                 "none", "--no-progress"]) == 0
    assert load_formats(tmp_path / "q") == ["fp8"]
    _, model = load(tmp_path / "q", weights="float8_e4m3fn")
    assert model_params(model)["layers.1.mlp.experts.gate"].dtype == ml_dtypes.float8_e4m3fn
    assert QuantizeSpec(weights="uint4", prefill_weights="e4m3").roles() == {"fp8": "prefill", "int4": "decode"}
    with pytest.raises(ConfigError) as e:
        QuantizeSpec(weights="bfloat16")
    assert (e.value.value, e.value.param) == ("bf16", "weights")
    assert main(["quantize", str(src), str(tmp_path / "q2"), "--weights", "float16", "--no-progress"]) == 2
    assert "'float16'" in capsys.readouterr().err
