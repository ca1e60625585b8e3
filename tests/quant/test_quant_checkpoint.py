"""`jaxserve quantize`: FP8 prefill + INT4 decode weights in one checkpoint, restored bit-exactly; bytes; errors."""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxserve
from flax import nnx

import hf_tiny
from jaxserve.convert.converter import convert
from jaxserve.checkpoint import load, load_formats, model_params
from jaxserve.cli import main
from jaxserve.errors import CheckpointError
from jaxserve.models import forward
from jaxserve.models.layers import Experts, Linear
from jaxserve.quant.apply import quantize_model, weight_bytes
from jaxserve.quant.weight_format import WeightFormat


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qckpt")
    hf_tiny.save(hf_tiny.build("deepseek_v3"), root / "hf")
    return convert(root / "hf", root / "bf16", progress=False)


@pytest.fixture(scope="module")
def quantized(ckpt, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("qout") / "q"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["quantize", str(ckpt), str(out), "--weights", "int4", "--group-size", "32", "--no-progress"])
    assert rc == 0
    return out, buf.getvalue()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_round_trip_equals_quantize_model(ckpt, quantized, fmt):
    out, _ = quantized
    _, base = load(ckpt)
    _, got = load(out, weights=fmt)
    want = quantize_model(base, WeightFormat(fmt, 32))
    a, b = model_params(got), model_params(want)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(_bits(a[k]), _bits(b[k])), k
    experts = _modules(got, Experts)
    assert experts and all(m.fmt == fmt for m in experts)
    assert a["layers.1.mlp.experts.gate"].dtype == (np.uint8 if fmt == "int4" else jnp.float8_e4m3fn)
    assert a["embed"].dtype == b["embed"].dtype == jnp.bfloat16  # embeddings never quantize
    toks = jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) % 256)
    np.testing.assert_array_equal(np.asarray(forward(got, toks)), np.asarray(forward(want, toks)))


def _modules(model, cls):  # noqa: ANN001, ANN202
    return [m for _, m in nnx.iter_graph(model) if isinstance(m, cls)]


def _int4_bytes(k: int, n: int, g: int) -> int:
    return k * n // 2 + (k // g) * n * 2  # packed nibbles + bf16 group scales


def _fp8_bytes(k: int, n: int) -> int:
    return k * n + math.ceil(k / 128) * math.ceil(n / 128) * 4  # e4m3 + f32 tile scales


def test_manifest_bytes_and_table(ckpt, quantized):
    out, printed = quantized
    man = json.loads((out / "jaxserve.json").read_text())
    assert man["base"] is False and set(man["formats"]) == {"fp8", "int4"}
    assert man["formats"]["fp8"]["role"] == "prefill" and man["formats"]["int4"]["role"] == "decode"
    assert load_formats(out) == ["fp8", "int4"] and load_formats(ckpt) == ["bf16"]
    assert (out / "config.json").exists() and not (out / "params").exists()
    cfg = load(ckpt)[0]
    moe_layers = cfg.mlp_layer_types.count("sparse")
    E, H, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    # independent count from the format definitions: gate, up [E, H, I] and down [E, I, H] per MoE layer
    want_int4 = moe_layers * E * (2 * _int4_bytes(H, inter, 32) + _int4_bytes(inter, H, 32))
    want_fp8 = moe_layers * E * (2 * _fp8_bytes(H, inter) + _fp8_bytes(inter, H))
    assert man["formats"]["int4"]["expert_bytes"] == want_int4
    assert man["formats"]["fp8"]["expert_bytes"] == want_fp8
    assert man["formats"]["int4"]["bytes"] == weight_bytes(load(out, weights="int4")[1])
    assert man["source_weights"]["expert_bytes"] == moe_layers * E * 3 * H * inter * 2
    ratio = want_int4 / want_fp8
    assert 0.5 < ratio < 0.6  # tiny tiles: 0.5625 / (1 + 4 / (64 * 32)) = 0.5614
    assert f"experts {ratio:.3f}" in printed and "int4 (decode)" in printed and "fp8 (prefill)" in printed


def test_decode_only_and_attention(ckpt, tmp_path):
    out = tmp_path / "q"
    assert main(["quantize", str(ckpt), str(out), "--prefill-weights", "none", "--attention", "--group-size", "16",
                 "--no-progress"]) == 0
    assert load_formats(out) == ["int4"]
    _, m = load(out, weights="int4")
    lin = {".".join(map(str, p)): x for p, x in nnx.iter_graph(m) if isinstance(x, Linear)}
    assert lin["layers.0.attn.kv_b"].fmt == "int4" and lin["layers.0.attn.q_a"].fmt == "int4"
    # INT4 covers the routed experts only by default (Kimi's recipe): the dense MLP and shared experts stay BF16
    assert lin["layers.0.mlp.gate"].fmt == "bf16" and lin["layers.1.mlp.shared.up"].fmt == "bf16"
    assert all(m.fmt == "int4" for m in _modules(m, Experts))


def test_int4_scope_mlps_and_manifests_without_a_scope(ckpt, tmp_path):
    out = tmp_path / "q"
    assert main(["quantize", str(ckpt), str(out), "--prefill-weights", "none", "--int4-scope", "mlps",
                 "--no-progress"]) == 0
    man = json.loads((out / "jaxserve.json").read_text())
    assert man["formats"]["int4"]["int4_scope"] == "mlps"
    _, m = load(out, weights="int4")
    lin = {".".join(map(str, p)): x for p, x in nnx.iter_graph(m) if isinstance(x, Linear)}
    assert lin["layers.0.mlp.gate"].fmt == "int4" and lin["layers.1.mlp.shared.up"].fmt == "int4"
    assert lin["layers.0.attn.kv_b"].fmt == "bf16"
    _, base = load(ckpt)
    want = model_params(quantize_model(base, WeightFormat("int4", 32, int4_scope="mlps")))
    # a checkpoint quantized before the scope was recorded held every MLP projection in INT4, and still loads
    del man["formats"]["int4"]["int4_scope"]
    (out / "jaxserve.json").write_text(json.dumps(man))
    got = model_params(load(out, weights="int4")[1])
    assert got.keys() == want.keys() and all(np.array_equal(_bits(got[k]), _bits(want[k])) for k in got)


def test_errors(ckpt, quantized, tmp_path, capsys):
    out, _ = quantized
    with pytest.raises(CheckpointError) as e:
        load(out)  # only quantized formats: the caller must say which
    assert e.value.param == "weights"
    with pytest.raises(CheckpointError) as e:
        load(out, weights="bf16")
    assert e.value.value == "bf16"
    with pytest.raises(CheckpointError) as e:
        load(ckpt, weights="int4")
    assert e.value.value == "int4"
    cases = [
        ([str(ckpt), str(out)], "already exists"),
        ([str(tmp_path / "nope"), str(tmp_path / "o1")], "not a complete jaxserve checkpoint"),
        ([str(ckpt), str(tmp_path / "o2"), "--weights", "int8"], "int8"),
        ([str(ckpt), str(tmp_path / "o3"), "--group-size", "3"], "positive even"),
        ([str(ckpt), str(tmp_path / "o4"), "--group-size", "48"], "48"),  # 64 % 48: cannot group experts
        ([str(ckpt), str(tmp_path / "o5"), "--attention"], "kv_b"),  # kv_b's input dim 16 % 32
        ([str(out), str(tmp_path / "o6")], "no BF16/F32 weights"),
    ]
    for argv, msg in cases:
        assert main(["quantize", *argv, "--no-progress"]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err, (argv, err)
    assert not any(p.name.endswith(".partial") or p.name.startswith("o") for p in tmp_path.iterdir())


def test_engine_serves_a_quantized_checkpoint_per_phase(tmp_path):
    """jaxserve quantize output: prefill runs the stored FP8 weights, decode the stored INT4 ones."""
    import hf_tiny
    from jaxserve.convert.converter import convert
    from jaxserve.engine import Engine, EngineConfig, SamplingParams
    from jaxserve.errors import ConfigError
    from jaxserve.quant.checkpoint import QuantizeSpec, quantize_checkpoint

    hf_tiny.save(hf_tiny.build("deepseek_v3"), tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "jx", dtype="float32", progress=False)
    quantize_checkpoint(tmp_path / "jx", tmp_path / "q", QuantizeSpec())
    cfg = EngineConfig(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4", dtype="float32", page_size=4,
                       num_decode_pages=32, num_prefill_pages=32, max_batch=4, max_prefill_tokens=16,
                       prefill_chunk=16, max_model_len=32, weight_layout="packed")  # stored formats stay packed
    e = Engine.from_checkpoint(tmp_path / "q", cfg, start=False)
    fmts = {ph: {m.fmt for _, m in nnx.iter_graph(nnx.merge(getattr(e.programs, ph).graphdef,
                                                                  getattr(e.programs, ph).state))
                 if type(m).__name__ == "Experts"} for ph in ("prefill_phase", "decode_phase")}
    assert fmts == {"prefill_phase": {"fp8"}, "decode_phase": {"int4"}}
    out = e.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    _, int4_model = jaxserve.load(tmp_path / "q", weights="int4")
    with pytest.raises(ConfigError, match="stored as int4"):  # an INT4 model cannot run an FP8 prefill phase
        Engine(int4_model, cfg, start=False)
