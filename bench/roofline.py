"""Decode-step roofline: the bytes one decode step must read, the machine's memory bandwidth, the lower bound on
step time, and jaxserve's measured step time against it.

Usage: python bench/roofline.py [--quick | --smoke] [--checkpoint DIR] --json OUT.json

Bytes per step = weights read + KV read. Weights: everything the step touches in the step's format (as in
jaxserve.quant: FP8 on routed experts, shared experts and dense MLPs, INT4 on routed experts only; the rest,
attention, router, norms and lm_head stay BF16; of the embedding table only the batch's rows), with routed experts either all or only the
activated ones: under uniform routing a batch of B tokens with top-k of E experts touches
E * (1 - (1 - k/E)^B) distinct experts per layer in expectation. KV: batch * context * KVLayout.bytes_per_token.
Bandwidth: a jitted sum over a large f32 array (read-only) and a jitted x + 1 (read + write), median of reps.
Lower bound = bytes / bandwidth (a step can not be faster than reading its bytes once; compute, launch and host
costs are not in it). Measured: the jitted decode program alone (as bench/integrity_overhead.py times it) and a
whole Engine.step (host scheduling included), tiny model, this machine. Kimi K2.6: bytes from its shapes; bounds
at an H200's nominal HBM bandwidth (4.8 TB/s, one GPU, and 8 GPUs tensor-parallel, communication ignored) and
the seeds' measured FP8-KV decode tokens/s turned into step times for comparison.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from jaxserve.cache import KVLayout  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.engine.layouts import kv_layout  # noqa: E402
from jaxserve.hlo_bytes import totals, traffic  # noqa: E402
from jaxserve.models import CausalLM  # noqa: E402
from jaxserve.quant import formats  # noqa: E402
from jaxserve.quant.apply import quantize_model  # noqa: E402
from jaxserve.quant.weight_format import WeightFormat  # noqa: E402
from jaxserve.targets import TARGETS  # noqa: E402

H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA's H200 SXM figure
SEEDS_FP8_KV_TOKENS_PER_S = {1: 125, 8: 689, 16: 1028, 64: 2192}  # FACTS.md, Kimi K2.6 decode pool


@dataclass(frozen=True)
class BenchSpec:
    """batches: decode rows; context: tokens per row already in the KV; formats: decode weight formats measured;
    copy_mib: bandwidth test array size; steps/reps: timing loop per measurement."""

    batches: tuple[int, ...] = (1, 8, 32)
    context: int = 128
    formats: tuple[str, ...] = ("bf16", "int4")
    copy_mib: int = 512
    steps: int = 10
    reps: int = 5


QUICK = BenchSpec(batches=(1, 8), formats=("int4",), copy_mib=256, steps=5, reps=3)
SMOKE = BenchSpec(batches=(1,), context=16, formats=("int4",), copy_mib=32, steps=2, reps=2)


@dataclass(frozen=True)
class KimiShapes:
    """Kimi K2.6 (DeepSeek-V3 backbone) decode-relevant shapes."""

    layers: int = 61
    dense_layers: int = 1
    hidden: int = 7168
    dense_inter: int = 18432
    experts: int = 384
    top_k: int = 8
    shared: int = 1
    expert_inter: int = 2048
    heads: int = 64
    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    vocab: int = 163840



# ---------------------------------------------------------------------------------------------------- bandwidth


def bandwidth(mib: int, reps: int) -> dict:
    """Measured bytes/s of a read-only reduction and of a read+write elementwise pass over mib MiB of f32."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    red = jax.jit(lambda a: jnp.sum(a))
    cpy = jax.jit(lambda a: a + 1.0)
    red(x).block_until_ready()
    cpy(x).block_until_ready()
    out = {}
    for name, f, moved in (("reduce_read", red, x.nbytes), ("copy_read_write", cpy, 2 * x.nbytes)):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f(x).block_until_ready()
            ts.append(time.perf_counter() - t)
        out[name] = moved / statistics.median(ts)
    out["array_bytes"] = x.nbytes
    out["used_for_bound"] = max(out["reduce_read"], out["copy_read_write"])
    return out


# ---------------------------------------------------------------------------------------------------- bytes


def expected_distinct(experts: int, k: int, tokens: int) -> float:
    """Expected distinct experts hit by `tokens` tokens each routing to k of `experts` (uniform routing)."""
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


def tiny_weight_groups(model: CausalLM, fmt: str) -> dict[str, int]:
    """Bytes of the model in decode format `fmt`, split: routed experts, embedding table, the rest."""
    q = model if fmt == "bf16" else quantize_model(model, WeightFormat(fmt, 32))
    _, state = nnx.split(q)
    g = {"routed_experts": 0, "embed": 0, "other": 0}
    for path, var in nnx.to_flat_state(state):
        p = ".".join(str(s) for s in path)
        v = var.get_value()
        b = int(v.size) * jnp.dtype(v.dtype).itemsize
        key = "routed_experts" if "experts" in p and "shared" not in p else "embed" if p.startswith("embed") \
            else "other"
        g[key] += b
    return g


def step_bytes(groups: dict[str, int], hidden: int, experts: int, k: int, moe_layers_frac: float, batch: int,
               context: int, kv_bytes_per_token: int, activated_only: bool) -> dict[str, float]:
    """Bytes one decode step reads for `batch` rows of `context` tokens."""
    frac = expected_distinct(experts, k, batch) / experts if activated_only else 1.0
    w = groups["other"] + groups["routed_experts"] * frac + batch * hidden * 2  # embedding rows: BF16
    kv = batch * context * kv_bytes_per_token
    return {"weights": w, "kv": kv, "total": w + kv, "expert_fraction_read": frac}


def kimi_groups(s: KimiShapes, fmt: str) -> dict[str, int]:
    """Kimi K2.6 bytes by group in decode format `fmt` (the MLP weights its default scope covers in fmt: INT4 the
    routed experts only, FP8 every MLP; everything else BF16)."""
    def mat_bytes(k: int, n: int, count: int, path: str = "layers.1.mlp.experts.gate") -> int:
        sds = jax.ShapeDtypeStruct((1, k, n), jnp.bfloat16)
        f = fmt if fmt == "bf16" or formats.quantizable(path, fmt) else "bf16"
        w, sc = jax.eval_shape(lambda x: formats.quantize(x, f, 32), sds)
        return count * formats.weight_bytes(w, sc)

    moe = s.layers - s.dense_layers
    attn = (s.hidden * s.q_lora + s.q_lora * s.heads * (s.qk_nope + s.qk_rope) + s.hidden * (s.kv_lora + s.qk_rope)
            + s.kv_lora * s.heads * (s.qk_nope + s.v_head) + s.heads * s.v_head * s.hidden)
    routed = moe * (2 * mat_bytes(s.hidden, s.expert_inter, s.experts) + mat_bytes(s.expert_inter, s.hidden, s.experts))
    sh, de = "layers.1.mlp.shared.up", "layers.0.mlp.up"
    shared = moe * s.shared * (2 * mat_bytes(s.hidden, s.expert_inter, 1, sh)
                               + mat_bytes(s.expert_inter, s.hidden, 1, sh))
    dense = s.dense_layers * (2 * mat_bytes(s.hidden, s.dense_inter, 1, de) + mat_bytes(s.dense_inter, s.hidden, 1, de))
    other_bf16 = 2 * (s.layers * attn + moe * s.hidden * s.experts + s.vocab * s.hidden)  # + router + lm_head
    return {"routed_experts": routed, "embed": 2 * s.vocab * s.hidden, "other": other_bf16 + shared + dense}


# ---------------------------------------------------------------------------------------------------- predicted


def device_target() -> str | None:
    """The jaxserve.targets name of this process's first device (by its device kind), None where it has none."""
    kind = jax.devices()[0].device_kind
    for name, match in (("h200", "H200"), ("h100", "H100")):
        if match in kind:
            return name
    return {"TPU v5": "v5p", "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}.get(kind)


def decode_hlo(engine: Engine, call: common.DecodeCall) -> str:
    """The compiled text of the decode program `engine` runs on `call` (the device's own compiler's)."""
    p = engine.programs
    ph = p.decode_phase
    spec = lambda tree: jax.tree.map(  # noqa: E731 - shapes only: the pool is donated by every call
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    return p._decode.lower(ph.params, spec(ph.pages), call.batch, call.samp).compile().as_text()


def predicted_step(hlo: str, minimum_bytes: float, measured_bytes_per_s: float) -> dict:
    """The roofline's step time for the compiled program `hlo` on this device (jaxserve/roofline.py, one device: no
    collectives): (minimum bytes + bytes moved outside the kernels + the XLA matmuls' activations) / HBM bandwidth,
    the chip's nominal one (jaxserve.targets) or, on a host that is none of them, the one measured here."""
    t = totals(traffic(hlo))
    name = device_target()
    bw = TARGETS[name].hbm_bytes_per_s if name else measured_bytes_per_s
    return {"predicted_s": (minimum_bytes + t["outside"] + t["matmul"]) / bw, "minimum_s": minimum_bytes / bw,
            "traffic_bytes": t, "hbm_bytes_per_s": bw,
            "bandwidth_from": TARGETS[name].bandwidth_source if name else "measured here (bandwidth())"}


# ---------------------------------------------------------------------------------------------------- measured


def bench_model(checkpoint: Path | None) -> tuple[str, CausalLM]:
    from jaxserve.checkpoint import load
    from jaxserve.cli import default_checkpoint

    ckpt = checkpoint or default_checkpoint()
    if (ckpt / "jaxserve.json").exists():
        return ckpt.name, load(ckpt, dtype=jnp.bfloat16)[1]
    if checkpoint is not None:
        load(checkpoint)
    from tools.train_tiny import ModelSize, hf_config_dict
    from jaxserve.config import from_hf_config

    cfg = from_hf_config(hf_config_dict(ModelSize()))
    return "random tiny-kimi architecture (checkpoints/tiny-kimi absent)", CausalLM(cfg, rngs=nnx.Rngs(0))


def measured_step(engine: Engine, batch: int, context: int, vocab: int, steps: int, reps: int) -> dict[str, float]:
    """Prefill `batch` rows of `context` tokens, then time (a) the decode program alone on the captured batch
    and (b) whole engine steps. Medians over reps, seconds per step."""
    rng = np.random.default_rng(batch)
    sched = engine.scheduler
    prompts = [rng.integers(1, vocab, context).tolist() for _ in range(batch)]
    call = common.steady_decode(engine, prompts, 2 * steps * reps + 16)
    prog, whole = [], []
    for _ in range(reps):  # program first, on the captured batch
        t = time.perf_counter()
        for _ in range(steps):
            engine.programs.run_decode(call.batch, call.samp)
        prog.append((time.perf_counter() - t) / steps)
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        whole.append((time.perf_counter() - t) / steps)
    hlo = decode_hlo(engine, call)
    for s in list(sched.running):
        engine.abort(s.req.request_id)
    engine.step()
    return {"program_s": statistics.median(prog), "engine_step_s": statistics.median(whole), "hlo": hlo}


def run(spec: BenchSpec, checkpoint: Path | None, progress: bool = True) -> dict:
    name, model = bench_model(checkpoint)
    cfg = model.cfg
    bw = bandwidth(spec.copy_mib, spec.reps)
    kv_fp8 = kv_layout(cfg, 16, "fp8").bytes_per_token()
    on_gpu = jax.default_backend() != "cpu"
    moe_frac = 1.0
    tiny_rows = []
    for fmt in tqdm(spec.formats, desc="decode formats", disable=not progress):
        groups = tiny_weight_groups(model, fmt)
        ecfg = EngineConfig(kv_dtype="fp8", prefill_weights="fp8", decode_weights=fmt, page_size=16,
                            num_decode_pages=max(spec.batches) * ((spec.context + 2 * spec.steps * spec.reps + 16) // 16 + 2) + 8,
                            num_prefill_pages=max(spec.batches) * (spec.context // 16 + 2) + 8,
                            max_batch=max(spec.batches), max_model_len=max(256, 2 * spec.context + 64),
                            prefix_cache=False, use_kernels=on_gpu,
                            attention=("pallas_tpu" if jax.default_backend() == "tpu" else "pallas") if on_gpu
                            else "xla")
        engine = Engine(model, ecfg, start=False)
        for b in spec.batches:
            m = measured_step(engine, b, spec.context, cfg.vocab_size, spec.steps, spec.reps)
            hlo = m.pop("hlo")
            ctx = spec.context + spec.steps * spec.reps  # the KV grows during the timing; use its middle
            row = {"format": fmt, "batch": b, "context": ctx, "weight_groups": groups, **m}
            for mode in ("activated", "all"):
                sb = step_bytes(groups, cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, moe_frac, b,
                                ctx, kv_fp8, activated_only=mode == "activated")
                bound = sb["total"] / bw["used_for_bound"]
                row[mode] = {**sb, "bound_s": bound, "program_over_bound": m["program_s"] / bound,
                             "engine_step_over_bound": m["engine_step_s"] / bound}
            row["predicted"] = predicted_step(hlo, row["activated"]["total"], bw["used_for_bound"])
            row["measured_over_predicted"] = m["program_s"] / row["predicted"]["predicted_s"]
            tiny_rows.append(row)
    ks = KimiShapes()
    kimi_rows = []
    for kv_dtype in ("bf16", "fp8"):
        kbpt = KVLayout.mla(ks.layers, ks.kv_lora, ks.qk_rope, dtype=kv_dtype).bytes_per_token()
        for fmt in ("bf16", "fp8", "int4"):
            g = kimi_groups(ks, fmt)
            for b in (1, 8, 16, 32, 64):
                ctx = 8192
                sb = step_bytes(g, ks.hidden, ks.experts, ks.top_k, 1.0, b, ctx, kbpt, activated_only=True)
                sa = step_bytes(g, ks.hidden, ks.experts, ks.top_k, 1.0, b, ctx, kbpt, activated_only=False)
                one = sb["total"] / H200_HBM_BYTES_PER_S
                row = {"kv_dtype": kv_dtype, "weights": fmt, "batch": b, "context": ctx, "activated": sb,
                       "all_total": sa["total"], "bound_s_1xH200": one, "bound_s_8xH200_tp": one / 8,
                       "tokens_per_s_bound_8xH200": b / (one / 8)}
                if kv_dtype == "fp8" and fmt == "int4" and b in SEEDS_FP8_KV_TOKENS_PER_S:
                    step = b / SEEDS_FP8_KV_TOKENS_PER_S[b]
                    row["seeds_step_s"] = step
                    row["seeds_step_over_8xH200_bound"] = step / (one / 8)
                kimi_rows.append(row)
    return {"bench": "roofline", "model": name, "machine": common.machine(), "spec": asdict(spec),
            "cpu_figures": jax.default_backend() == "cpu", "bandwidth_bytes_per_s": bw,
            "tiny": {"kv_bytes_per_token_fp8": kv_fp8, "rows": tiny_rows},
            "kimi_k2.6": {"shapes": asdict(ks), "h200_hbm_bytes_per_s": H200_HBM_BYTES_PER_S, "rows": kimi_rows,
                          "note": "context 8192 per row; routed experts activated (uniform routing expectation); "
                                  "MLPs in the weight format (INT4: routed experts only), attention/router/lm_head "
                                  "BF16; the seeds' step times come from their FP8-KV tokens/s (their weights' "
                                  "format and GPU count are not stated for that table; 8 GPUs assumed here)"},
            "notes": "lower bound = bytes / measured bandwidth; on CPU a tiny model's step is dominated by "
                     "per-op overhead, so the measured/bound ratio is large and says little about an H200"}


def table(r: dict) -> str:
    bw = r["bandwidth_bytes_per_s"]
    lines = [f"bandwidth ({r['machine']['cpu']}): reduce {bw['reduce_read'] / 1e9:.1f} GB/s, copy "
             f"{bw['copy_read_write'] / 1e9:.1f} GB/s",
             f"tiny ({r['model']}), decode step, context ~{r['tiny']['rows'][0]['context']}:",
             f"  {'fmt':<5} {'batch':>5} {'MB act':>8} {'MB all':>8} {'bound us':>9} {'program us':>11} "
             f"{'step us':>9} {'prog/bound':>11}"]
    for row in r["tiny"]["rows"]:
        a, al = row["activated"], row["all"]
        lines.append(f"  {row['format']:<5} {row['batch']:>5} {a['total'] / 1e6:>8.3f} {al['total'] / 1e6:>8.3f} "
                     f"{a['bound_s'] * 1e6:>9.1f} {row['program_s'] * 1e6:>11.1f} {row['engine_step_s'] * 1e6:>9.1f}"
                     f" {a['program_over_bound']:>11.1f}")
    lines.append("kimi-k2.6, FP8 KV, 8192 context, activated experts: GB/step and 8xH200 bound (ms) by weights:")
    for row in r["kimi_k2.6"]["rows"]:
        if row["kv_dtype"] != "fp8":
            continue
        extra = f"  seeds {row['seeds_step_s'] * 1e3:.2f} ms ({row['seeds_step_over_8xH200_bound']:.1f}x)" \
            if "seeds_step_s" in row else ""
        lines.append(f"  {row['weights']:<5} batch {row['batch']:>3}: {row['activated']['total'] / 1e9:7.2f} GB, "
                     f"{row['bound_s_8xH200_tp'] * 1e3:6.3f} ms{extra}")
    for row in r["tiny"]["rows"]:  # the first check of the roofline model on whatever device this ran on
        p = row["predicted"]
        lines.append(f"  measured vs predicted step, {row['format']} batch {row['batch']}: program "
                     f"{row['program_s'] * 1e6:.1f} us vs predicted {p['predicted_s'] * 1e6:.1f} us (a bound, at "
                     f"{p['hbm_bytes_per_s'] / 1e9:.0f} GB/s; {row['measured_over_predicted']:.1f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--smoke", action="store_true")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    spec = SMOKE if args.smoke else QUICK if args.quick else BenchSpec()
    if args.batches:
        spec = replace(spec, batches=tuple(args.batches))
    r = run(spec, args.checkpoint)
    return common.write_result(r, table(r), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
