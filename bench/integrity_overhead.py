"""KV integrity check cost: decode throughput with the tag check on vs off, measured side by side.

Usage: python bench/integrity_overhead.py [--quick | --smoke] [--checkpoint DIR] --json OUT.json

Two engines share one model and differ only in EngineConfig.integrity (on: the tag check against the pool's
device tags, the failed-row null-page guard, and the tag stamp in every KV write). For each batch size, both are
brought to the same steady decode state (the same prompts prefilled), then timed rounds alternate on, off, on,
off, ...; each round runs `steps` decode-program calls on the same batch (the real jitted decode program, host
scheduling excluded). Reported: median over rounds of tokens/s(on) / tokens/s(off) and cost = 1 - ratio. Goal: <= 0.5%.
Also the check alone (jitted check_tags on the same batch) as a share of one decode step: on a noisy shared CPU
the end-to-end ratio's spread can exceed the effect, and this bounds it from below the noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402


def load_model(checkpoint: Path | None):  # noqa: ANN201
    import jax.numpy as jnp

    from jaxserve.checkpoint import load

    if checkpoint is not None and (checkpoint / "jaxserve.json").exists():
        return checkpoint.name, load(checkpoint, dtype=jnp.bfloat16)[1]
    from flax import nnx

    from jaxserve.config import from_hf_config
    from jaxserve.models import CausalLM

    cfg = from_hf_config(dict(model_type="deepseek_v3", vocab_size=4096, hidden_size=256, intermediate_size=768,
                              moe_intermediate_size=256, num_hidden_layers=4, first_k_dense_replace=1,
                              num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                              qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                              n_shared_experts=1, max_position_embeddings=2048))
    return "random-tiny-kimi", CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def time_steps(engine: Engine, call: common.DecodeCall, steps: int) -> float:
    """Seconds for `steps` decode-program calls (synchronized by the host read of the tokens)."""
    t = time.perf_counter()
    for _ in range(steps):
        engine.programs.run_decode(call.batch, call.samp)
    return time.perf_counter() - t


def check_only_seconds(engine: Engine, call: common.DecodeCall, reps: int) -> float:
    """Median seconds of the tag check alone (the jitted check_tags against the pool's device tags) on the
    captured batch."""
    from jaxserve.cache import check_tags

    b = call.batch
    args = (engine.programs.decode_phase.pages.tags, b.block_tables, b.expected_tags, b.num_pages)
    check_tags(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        check_tags(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CI-sized: one batch size, few rounds (schema check only)")
    ap.add_argument("--checkpoint", type=Path, default=Path(__file__).resolve().parents[1] / "checkpoints/tiny-kimi")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    batches = (1,) if args.smoke else (1, 8) if args.quick else (1, 8, 32)
    rounds, steps = (3, 2) if args.smoke else (5, 5) if args.quick else (41, 10)
    name, model = load_model(args.checkpoint)
    on_gpu = jax.default_backend() != "cpu"
    base = dict(kv_dtype="fp8", prefill_weights="fp8", decode_weights="int4", page_size=16, num_decode_pages=512,
                num_prefill_pages=512, max_batch=max(batches), max_model_len=512, prefix_cache=False,
                use_kernels=on_gpu, attention="pallas" if on_gpu else "xla")
    rows = []
    load_before = os.getloadavg()  # the host is shared: its load is part of the figure
    for b in tqdm(batches, desc="integrity overhead"):
        engines = {flag: Engine(model, EngineConfig(integrity=flag, **base), start=False) for flag in (True, False)}
        rng = np.random.default_rng(0)
        prompts = [list(map(int, rng.integers(0, model.cfg.vocab_size, 128))) for _ in range(b)]
        caps = {flag: common.steady_decode(e, prompts, 10_000) for flag, e in engines.items()}
        for flag, e in engines.items():
            time_steps(e, caps[flag], 2)  # warm
        ratios, on_t, off_t = [], [], []
        for _ in range(rounds):
            t_on = time_steps(engines[True], caps[True], steps)
            t_off = time_steps(engines[False], caps[False], steps)
            on_t.append(t_on)
            off_t.append(t_off)
            ratios.append(t_off / t_on)  # tokens/s(on) / tokens/s(off)
        med = statistics.median(ratios)
        step_s = statistics.median(off_t) / steps
        check_s = check_only_seconds(engines[True], caps[True], 50)
        rows.append({"batch": b, "median_ratio": med, "cost_pct": 100 * (1 - med),
                     "check_alone_s": check_s, "decode_step_s": step_s,
                     "check_alone_pct_of_step": 100 * check_s / step_s,
                     "tokens_per_s_on": b * steps / statistics.median(on_t),
                     "tokens_per_s_off": b * steps / statistics.median(off_t),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": rounds, "steps": steps})
        for e in engines.values():
            e.close()
    result = {"model": name, "backend": jax.default_backend(), "device": str(jax.devices()[0]),
              "machine": common.machine(), "kv_dtype": "fp8", "decode_weights": "int4",
              "load_avg_1_5_15": {"before": list(load_before), "after": list(os.getloadavg())},
              "median_ratio": statistics.median(r["median_ratio"] for r in rows),
              "cost_pct": statistics.median(r["cost_pct"] for r in rows), "goal_cost_pct": 0.5, "rows": rows}
    print(f"{'batch':>5} {'tok/s on':>10} {'tok/s off':>10} {'ratio':>7} {'cost %':>7} {'min..max':>14} "
          f"{'check alone % of step':>22}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tokens_per_s_on']:>10.1f} {r['tokens_per_s_off']:>10.1f} {r['median_ratio']:>7.4f}"
              f" {r['cost_pct']:>7.2f} {r['ratio_min']:.3f}..{r['ratio_max']:.3f} "
              f"{r['check_alone_pct_of_step']:>22.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
