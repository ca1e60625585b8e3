"""Peer comparison: the same tiny model through transformers' generate() (PyTorch, CPU), llama.cpp and jaxserve.

Usage: python bench/peer_transformers.py [--quick | --smoke] [--checkpoint DIR] [--torch-threads N]
       [--llama-threads N] --json OUT.json

The jaxserve model (checkpoints/tiny-kimi, or a random model of its architecture when absent) is exported to an
HF folder with tools.train_tiny.export_hf (f32, the real transformers DeepseekV3 format) and loaded with
AutoModelForCausalLM (eager attention, f32). Both sides get the same prompts (equal length, so no padding), the
same greedy decoding and exactly `new_tokens` tokens (eos ignored: min_new_tokens = max_new_tokens in HF,
ignore_eos in jaxserve), at concurrency 1 (one prompt) and 16 (one batch of 16 / 16 concurrent requests).
tokens/s = generated tokens / wall seconds of the whole call (prefill included on both sides), median of
interleaved runs after a warm-up (jaxserve compiles its shape buckets on first use; HF warms its kernels).
Two jaxserve configurations: "f32" (f32 weights in both phases, BF16 KV: the closest to the HF reference) and
"serving" (BF16 model, FP8 prefill / INT4 decode weights, FP8 KV: the default recipe).
Agreement: per row, whether the greedy tokens equal HF's, and the common prefix length (greedy paths fork at
the first near-tie, after which the rest differs by construction).
Every timing is reported as median and min..max with the host's load average beside it (the host is shared).
Lower bound: the minimal jitted dense-KV decode step of the same f32 model (`bench.common.minimal_decode_step`)
at each concurrency, against the engine's steady-state decode step (one `Engine.step()` with every row decoding,
host work included) and its decode program alone: "engine step / minimal step", at each concurrency and at
step_batches (1, 8, 32). Context: the decode program and one layer's attention at contexts (1030, 2000) tokens,
batch 1 and 16, and in the 2000-token bucket with the rows' lengths cut to 1030 (attention loops over live pages).
Prefill: one prompt of each of prefill_lengths (256, 2000) with one new token, interleaved: prompt tokens/s of the
whole call, and the longest length's over the shortest's.
The HF side's threads: `--torch-threads` (recorded); on a loaded shared host 1 thread ran 25x faster than 2.
llama.cpp (optional, `make peers`; bench/peer_llamacpp.py): the same HF folder converted to an f32 GGUF by the
converter shipped with the pinned llama-cpp-python, run as llama.cpp's `deepseek2` with `--llama-threads` threads
(default: torch's thread count) for prefill and decode; concurrency c = one context of c sequences decoded in one
batch per step. It is timed, interleaved and compared with HF like the jaxserve configs; when it is not installed
its rows say so ("llama_cpp.status" in the JSON) and the rest runs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common, peer_llamacpp  # noqa: E402
from jaxserve.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from jaxserve.models import CausalLM  # noqa: E402


@dataclass(frozen=True)
class BenchSpec:
    """concurrency: rows per call; prompt_len/new_tokens: each row's workload; reps: timed runs per side;
    configs: the jaxserve engine configurations run ("f32", "serving")."""

    concurrency: tuple[int, ...] = (1, 16)
    prompt_len: int = 64
    new_tokens: int = 32
    reps: int = 3
    seed: int = 0
    configs: tuple[str, ...] = ("f32", "serving")
    step_reps: int = 12  # timed steady-state engine steps / decode-program calls per config and concurrency
    step_batches: tuple[int, ...] = (1, 8, 32)  # engine step / minimal step at these batch sizes
    contexts: tuple[int, ...] = (1030, 2000)  # decode program at these context lengths (serving config) ...
    context_batches: tuple[int, ...] = (1, 16, 64)  # ... and these batch sizes (64: the seeds' decode batch)
    prefill_lengths: tuple[int, ...] = (256, 2000)  # one prompt of each length, 1 new token: prefill tokens/s


QUICK = BenchSpec(prompt_len=32, new_tokens=16, reps=2)
SMOKE = BenchSpec(concurrency=(1, 2), prompt_len=8, new_tokens=4, reps=1, configs=("f32",), step_reps=2,
                  step_batches=(1, 2), contexts=(20, 40), context_batches=(2,), prefill_lengths=(16, 40))


def machine() -> dict:
    """What ran this: the common machine description plus the PyTorch side's versions and threads."""
    import torch
    import transformers

    return {**common.machine(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__}


def bench_models(checkpoint: Path | None) -> tuple[str, CausalLM, CausalLM]:
    """(name, f32 model, bf16 model) of the checkpoint (default checkpoints/tiny-kimi) or a random tiny-kimi."""
    from flax import nnx

    from jaxserve.checkpoint import load
    from jaxserve.cli import default_checkpoint

    ckpt = checkpoint or default_checkpoint()
    if (ckpt / "jaxserve.json").exists():
        return ckpt.name, load(ckpt, dtype=jnp.float32)[1], load(ckpt, dtype=jnp.bfloat16)[1]
    if checkpoint is not None:
        load(checkpoint)  # raises the typed CheckpointError naming what is missing
    from tools.train_tiny import ModelSize, hf_config_dict
    from jaxserve.config import from_hf_config

    cfg = from_hf_config(hf_config_dict(ModelSize()))
    # the initializers draw in f32 and cast, so the same seed gives the same weights (rounded) in both dtypes
    return ("random tiny-kimi architecture (checkpoints/tiny-kimi absent)",
            CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))


def hf_model(model: CausalLM, out: Path):  # noqa: ANN201 - a transformers PreTrainedModel
    """Export the f32 jaxserve model as an HF folder and load it with transformers."""
    import torch
    import transformers

    from tools.train_tiny import ModelSize, export_hf, hf_config_dict

    raw = hf_config_dict(ModelSize())
    if raw["vocab_size"] != model.cfg.vocab_size or raw["hidden_size"] != model.cfg.hidden_size:
        raise SystemExit("peer_transformers exports the tiny-kimi architecture only (ModelSize())")
    export_hf(model, raw, out)
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def engine_config(kind: str, spec: BenchSpec) -> EngineConfig:
    rows = max(spec.concurrency + spec.step_batches)
    pages = rows * (-(-(spec.prompt_len + spec.new_tokens + spec.step_reps + 9) // 16)) + 8
    on_gpu = jax.default_backend() != "cpu"
    fmt = dict(prefill_weights="f32", decode_weights="f32", kv_dtype="bf16", dtype="float32") if kind == "f32" \
        else dict(prefill_weights="fp8", decode_weights="int4", kv_dtype="fp8")
    return EngineConfig(**fmt, num_decode_pages=pages, num_prefill_pages=pages, max_batch=rows,
                        max_model_len=256, prefix_cache=False, use_kernels=on_gpu and kind != "f32",
                        attention="pallas" if on_gpu else "xla")


def run_hf(hf, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:  # noqa: ANN001
    """One generate() call -> (seconds, generated tokens [rows, new_tokens])."""
    import torch

    ids = torch.from_numpy(prompts).long()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t0
    return dt, out[:, prompts.shape[1]:].numpy()


def run_js(engine: Engine, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:
    """One Engine.generate call over all rows (concurrent requests) -> (seconds, tokens [rows, new_tokens])."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts.tolist(), SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    dt = time.perf_counter() - t0
    if any(o.error is not None for o in outs):
        raise next(o.error for o in outs if o.error is not None)
    return dt, np.array([o.token_ids for o in outs])


def engine_step_times(engine: Engine, prompts: np.ndarray, steps: int) -> dict:
    """Steady-state decode: every row of `prompts` decoding; spread of `Engine.step()` seconds (host work
    included) and of the decode program alone (`Programs.run_decode` on the captured arguments)."""
    from jaxserve.engine.request import Status

    call = common.steady_decode(engine, prompts.tolist(), max_tokens=steps + 8)
    prog = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.programs.run_decode(call.batch, call.samp)
        prog.append(time.perf_counter() - t0)
    sched = engine.scheduler
    step = []
    for _ in range(steps):
        if sum(s.status is Status.DECODING for s in sched.running) < len(prompts):
            break
        t0 = time.perf_counter()
        engine.step()
        step.append(time.perf_counter() - t0)
    for seq in list(sched.running):
        engine.abort(seq.req.request_id)
    while sched.has_work():
        engine.step()
    return {"engine_step_s": common.spread(step), "decode_program_s": common.spread(prog),
            "loadavg": os.getloadavg()[0]}


def context_times(model: CausalLM, kind: str, spec: BenchSpec) -> list[dict]:
    """The decode program at each context of spec.contexts, for each batch of spec.context_batches: every row
    that long, in the context's own page bucket, and the longest context's bucket with the rows' lengths cut to
    each shorter context (what the length-bounded attention saves within one compiled program). The rows read
    pages of a fresh pool (the program's cost does not depend on what they hold), so no prefill is needed."""
    from jaxserve.engine.batch import dummy_decode
    from jaxserve.models.paged import DecodeBatch
    from jaxserve.models.paged_attention_xla import mla_decode

    top = max(spec.contexts)
    window = top + 16
    per_row = -(-window // 16)
    out = []
    for b in spec.context_batches:
        cfg = replace(engine_config(kind, spec), max_batch=b, max_model_len=window,
                      num_decode_pages=b * per_row + 9, num_prefill_pages=16)
        engine = Engine(model, cfg, start=False)

        def batch(n: int, m: int) -> tuple[DecodeBatch, object]:
            pages = 1 + np.arange(b * m, dtype=np.int32).reshape(b, m)  # distinct pages per row, null page unused
            pos = np.full(b, n - 1, np.int32)
            slots = pages[:, (n - 1) // 16] * 16 + (n - 1) % 16
            arrs = (np.zeros(b, np.int32), pos, slots, pages, pos + 1, np.zeros((b, m), np.uint32),
                    np.full(b, -(-n // 16), np.int32))
            return DecodeBatch(*(jnp.asarray(a) for a in arrs)), dummy_decode(b, m)[1]

        def program(db: DecodeBatch, samp: object) -> dict:
            # fresh pool: every page's device tag is 0, as the rows expect; compile (first use of the bucket) and check
            _, ok = engine.programs.run_decode(db, samp)
            if not ok.all():
                raise RuntimeError("context bench: a row failed the tag check")
            ts = []
            for _ in range(spec.step_reps):
                t0 = time.perf_counter()
                engine.programs.run_decode(db, samp)
                ts.append(time.perf_counter() - t0)
            return common.spread(ts)

        def attention(db: DecodeBatch) -> dict:
            """One layer's decode attention alone (models/paged_attention_xla.py), on the same pool and rows."""
            mc, pages = model.cfg, engine.programs.decode_phase.pages
            q = jnp.ones((b, mc.num_heads, mc.kv_lora_rank + mc.qk_rope_head_dim), jnp.float32)
            fn = jax.jit(lambda q, lat, sc, bt, n: mla_decode(q, lat, sc, bt, n, layer=0, layout=pages.layout,
                                                              kv_lora_rank=mc.kv_lora_rank, softmax_scale=0.1))
            args = (q, pages.latent, pages.latent_scale, db.block_tables, db.lengths)
            fn(*args).block_until_ready()
            ts = []
            for _ in range(spec.step_reps):
                t0 = time.perf_counter()
                fn(*args).block_until_ready()
                ts.append(time.perf_counter() - t0)
            return common.spread(ts)

        top_m = cfg.pick(cfg.page_buckets, -(-top // 16))
        for n in spec.contexts:
            m = cfg.pick(cfg.page_buckets, -(-n // 16))
            db, samp = batch(n, m)
            row = {"batch": b, "context": n, "pages_bucket": m, "decode_program_s": program(db, samp),
                   "attention_layer_s": attention(db)}
            if n < top:
                db, samp = batch(top, top_m)
                db = replace(db, lengths=jnp.full((b,), n, jnp.int32))
                row["same_bucket_as_longest_s"] = program(db, samp)
                row["attention_layer_same_bucket_s"] = attention(db)
            row["loadavg"] = os.getloadavg()[0]
            out.append(row)
        engine.close()
    return out


def prefill_times(model: CausalLM, kind: str, spec: BenchSpec) -> dict:
    """Prompt tokens/s of one request per length of spec.prefill_lengths (1 new token, so the call is its prefill:
    chunks of the default prefill_chunk, each attending to everything before it), interleaved, fresh random
    prompts each time (no prefix cache). -> {rows: [{prompt_len, seconds, tokens_per_s}], longest_over_shortest}."""
    window = max(spec.prefill_lengths) + 16
    pages = -(-window // 16) + 8
    cfg = replace(engine_config(kind, spec), max_batch=1, max_model_len=window, num_decode_pages=pages,
                  num_prefill_pages=pages)
    engine = Engine(model, cfg, start=False)
    rng = np.random.default_rng(spec.seed + 1)
    prompt = lambda n: rng.integers(1, model.cfg.vocab_size, size=(1, n))  # noqa: E731
    for n in spec.prefill_lengths:
        run_js(engine, prompt(n), 1)  # compiles this length's buckets
    times: dict[int, list[float]] = {n: [] for n in spec.prefill_lengths}
    loads = []
    for _ in range(max(3, spec.reps)):
        for n in spec.prefill_lengths:
            times[n].append(run_js(engine, prompt(n), 1)[0])
        loads.append(os.getloadavg()[0])
    engine.close()
    rows = [{"prompt_len": n, "seconds": common.spread(ts), "tokens_per_s": n / statistics.median(ts)}
            for n, ts in times.items()]
    return {"config": kind, "prefill_chunk": cfg.prefill_chunk, "rows": rows, "loadavg_per_rep": loads,
            "longest_over_shortest": rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]}


def agreement(ref: np.ndarray, got: np.ndarray) -> dict:
    """Rows equal, and the mean common-prefix length as a fraction of the tokens."""
    same = ref == got
    prefix = [int(np.argmin(r)) if not r.all() else len(r) for r in same]
    return {"rows_equal": int(same.all(axis=1).sum()), "rows": len(ref), "token_match": float(same.mean()),
            "mean_common_prefix_frac": float(np.mean(prefix) / ref.shape[1])}


def run(spec: BenchSpec, checkpoint: Path | None, progress: bool = True, llama_threads: int | None = None) -> dict:
    import torch

    host = machine()  # before the runs: its load average is the one at the start
    name, m32, m16 = bench_models(checkpoint)
    llama = {"status": peer_llamacpp.status(), "threads": llama_threads or torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as td:
        hf = hf_model(m32, Path(td) / "hf")
        if llama["status"] == "ok":
            t0 = time.perf_counter()
            gguf = peer_llamacpp.export_gguf(Path(td) / "hf", Path(td) / "model-f32.gguf")
            llama["gguf_export_s"] = time.perf_counter() - t0
            # each concurrency gets its own context (n_seq_max = c); the model file is read now, while td exists
            llamas = {c: peer_llamacpp.LlamaCpp(gguf, peer_llamacpp.LlamaCppConfig(
                rows=c, context=spec.prompt_len + spec.new_tokens, threads=llama["threads"]))
                for c in spec.concurrency}
            llama["version"] = peer_llamacpp.VERSION
            llama["context_params"] = {c: m.params for c, m in llamas.items()}
        else:
            llamas = {}
    engines = {k: Engine(m32 if k == "f32" else m16, engine_config(k, spec), start=False) for k in spec.configs}
    sides = ("hf", *(("llama.cpp",) if llamas else ()), *engines)
    peers = [s for s in sides if s != "hf"]
    rng = np.random.default_rng(spec.seed)
    rows = []
    for c in tqdm(spec.concurrency, desc="concurrency", disable=not progress):
        prompts = rng.integers(1, m32.cfg.vocab_size, size=(c, spec.prompt_len)).astype(np.int64)

        def call(side: str) -> tuple[float, np.ndarray]:
            if side == "hf":
                return run_hf(hf, prompts, spec.new_tokens)
            if side == "llama.cpp":
                return llamas[c].generate(prompts, spec.new_tokens)
            return run_js(engines[side], prompts, spec.new_tokens)

        outs = {s: call(s)[1] for s in sides}  # warm-up (compiles), and the outputs compared below
        times: dict[str, list[float]] = {s: [] for s in sides}
        loads: list[float] = []
        for _ in range(spec.reps):
            for s in sides:  # interleaved: host noise hits every side alike
                times[s].append(call(s)[0])
            loads.append(os.getloadavg()[0])
        tps = {s: c * spec.new_tokens / statistics.median(times[s]) for s in sides}
        tps_range = {s: [c * spec.new_tokens / max(times[s]), c * spec.new_tokens / min(times[s])] for s in sides}
        context = spec.prompt_len + spec.new_tokens + 1
        minimal = common.time_minimal_step(m32, c, context)
        steps = {s: engine_step_times(engines[s], prompts, spec.step_reps) for s in engines}
        rows.append({"concurrency": c, "tokens_per_s": tps, "tokens_per_s_min_max": tps_range,
                     "seconds": {s: common.spread(times[s]) for s in sides}, "seconds_raw": times,
                     "loadavg_per_rep": loads,
                     "jaxserve_over_hf": {s: tps[s] / tps["hf"] for s in engines},
                     "llama_cpp_over_hf": tps["llama.cpp"] / tps["hf"] if llamas else llama["status"],
                     "jaxserve_over_llama_cpp": {s: tps[s] / tps["llama.cpp"] for s in engines} if llamas
                     else llama["status"],
                     "agreement_vs_hf": {s: agreement(outs["hf"], outs[s]) for s in peers},
                     "minimal_step_s": minimal, "engine_steps": steps,
                     "engine_step_over_minimal": {s: steps[s]["engine_step_s"]["median"] / minimal["median"]
                                                  for s in engines},
                     "decode_program_over_minimal": {s: steps[s]["decode_program_s"]["median"] / minimal["median"]
                                                     for s in engines}})
    context = spec.prompt_len + spec.new_tokens + 1
    step_rows = []
    for b in tqdm(spec.step_batches, desc="step batches", disable=not progress):
        prompts = rng.integers(1, m32.cfg.vocab_size, size=(b, spec.prompt_len))
        minimal = common.time_minimal_step(m32, b, context)
        steps = {s: engine_step_times(engines[s], prompts, spec.step_reps) for s in engines}
        step_rows.append({"batch": b, "minimal_step_s": minimal, "engine_steps": steps,
                          "engine_step_over_minimal": {s: steps[s]["engine_step_s"]["median"] / minimal["median"]
                                                       for s in engines},
                          "decode_program_over_minimal": {s: steps[s]["decode_program_s"]["median"]
                                                          / minimal["median"] for s in engines}})
    for m in llamas.values():
        m.close()
    kind = "serving" if "serving" in engines else spec.configs[0]
    ctx_rows = context_times(m16 if kind == "serving" else m32, kind, spec)
    prefill = prefill_times(m16 if kind == "serving" else m32, kind, spec)
    return {"bench": "peer_transformers", "model": name, "machine": host, "spec": asdict(spec),
            "cpu_figures": jax.default_backend() == "cpu", "torch_threads": torch.get_num_threads(),
            "llama_cpp": llama,
            "configs": {"hf": "transformers generate(), f32, eager attention, greedy",
                        "llama.cpp": "llama.cpp (llama-cpp-python low-level API), f32 GGUF, one batch of c"
                                     " sequences per step, greedy argmax",
                        "f32": "jaxserve Engine, f32 weights, BF16 KV", "serving":
                        "jaxserve Engine, BF16 model, FP8 prefill / INT4 decode weights, FP8 KV"},
            "rows": rows, "step_rows": step_rows, "context_config": kind, "context_rows": ctx_rows,
            "prefill": prefill,
            "loadavg_at_end": os.getloadavg(),
            "notes": "medians (min..max) of interleaved runs after a warm-up of both sides; wall time of the whole"
                     " call (prefill included); shared CPU host, load average per repetition recorded;"
                     " minimal_step_s: dense-KV jitted decode step of the f32 model (the lower bound);"
                     f" llama.cpp: {llama['status']}"}


def table(r: dict) -> str:
    lines = [f"model: {r['model']}  (tokens/s, whole generate call)",
             f"  {'conc':>4} {'hf':>9} {'llama.cpp':>10} {'js f32':>9} {'js serving':>11} {'f32/hf':>7} "
             f"{'serv/hf':>8} {'serv/llama':>10} {'agree llama':>11} {'agree f32':>10} {'agree serv':>11}"]
    for row in r["rows"]:
        t, q, a = row["tokens_per_s"], row["jaxserve_over_hf"], row["agreement_vs_hf"]
        ql = row["jaxserve_over_llama_cpp"] if isinstance(row["jaxserve_over_llama_cpp"], dict) else {}
        ag = lambda x: f"{x['rows_equal']}/{x['rows']} {x['token_match']:.2f}"  # noqa: E731
        g = lambda d, k, f: f(d[k]) if k in d else "-"  # noqa: E731 - a config may not have run
        lines.append(f"  {row['concurrency']:>4} {t['hf']:>9.1f} {g(t, 'llama.cpp', '{:.1f}'.format):>10} "
                     f"{g(t, 'f32', '{:.1f}'.format):>9} {g(t, 'serving', '{:.1f}'.format):>11} "
                     f"{g(q, 'f32', '{:.2f}'.format):>7} {g(q, 'serving', '{:.2f}'.format):>8} "
                     f"{g(ql, 'serving', '{:.2f}'.format):>10} {g(a, 'llama.cpp', ag):>11} {g(a, 'f32', ag):>10} "
                     f"{g(a, 'serving', ag):>11}")
    lines.append("  agree: rows identical / fraction of token positions equal (vs hf)")
    lc = r["llama_cpp"]
    lines.append(f"  llama.cpp: {lc['status']}" + (f", {lc['threads']} threads, GGUF export "
                                                    f"{lc['gguf_export_s']:.1f} s" if lc["status"] == "ok" else ""))
    lines.append(f"  {'conc':>4} {'minimal ms':>11} " + " ".join(f"{'step ' + k + ' ms':>16} {'x min':>6}"
                                                            f" {'prog ms':>8}" for k in r["rows"][0]["engine_steps"]))
    for row in r["rows"]:
        cells = [f"{st['engine_step_s']['median'] * 1e3:>16.2f} {row['engine_step_over_minimal'][k]:>6.1f}"
                 f" {st['decode_program_s']['median'] * 1e3:>8.2f}" for k, st in row["engine_steps"].items()]
        lines.append(f"  {row['concurrency']:>4} {row['minimal_step_s']['median'] * 1e3:>11.2f} " + " ".join(cells))
    heads = [f"{'step ' + k + ' ms':>16} {'x min':>6} {'prog ms':>8} {'x min':>6}"
             for k in r["step_rows"][0]["engine_steps"]]
    lines.append(f"  {'batch':>5} {'minimal ms':>11} " + " ".join(heads))
    for row in r["step_rows"]:
        cells = [f"{st['engine_step_s']['median'] * 1e3:>16.2f} {row['engine_step_over_minimal'][k]:>6.1f}"
                 f" {st['decode_program_s']['median'] * 1e3:>8.2f} {row['decode_program_over_minimal'][k]:>6.1f}"
                 for k, st in row["engine_steps"].items()]
        lines.append(f"  {row['batch']:>5} {row['minimal_step_s']['median'] * 1e3:>11.2f} " + " ".join(cells))
    lines.append(f"  {r['context_config']}: {'batch':>5} {'context':>7} {'bucket':>6} {'program ms':>10} "
                 f"{'in longest bucket':>17} {'attn layer ms':>13} {'in longest bucket':>17}")
    ms = lambda row, k: row[k]["median"] * 1e3 if k in row else float("nan")  # noqa: E731
    for row in r["context_rows"]:
        lines.append(f"  {'':>{len(r['context_config']) + 1}} {row['batch']:>5} {row['context']:>7} "
                     f"{row['pages_bucket']:>6} {ms(row, 'decode_program_s'):>10.2f} "
                     f"{ms(row, 'same_bucket_as_longest_s'):>17.2f} {ms(row, 'attention_layer_s'):>13.3f} "
                     f"{ms(row, 'attention_layer_same_bucket_s'):>17.3f}")
    pf = r["prefill"]
    lines.append(f"  {pf['config']} prefill (one prompt, chunks of {pf['prefill_chunk']}): " + ", ".join(
        f"{row['prompt_len']} tokens {row['tokens_per_s']:.0f} tok/s" for row in pf["rows"])
        + f"; longest / shortest {pf['longest_over_shortest']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="shorter prompts and outputs (about a minute)")
    mode.add_argument("--smoke", action="store_true", help="concurrency 1 and 2, 4 tokens (CI schema check)")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=None)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads for the HF side (default: torch's own, one per core); on a "
                         "loaded shared host 1 thread measured 25x faster than 2 (OpenMP threads wait on each other)")
    ap.add_argument("--llama-threads", type=int, default=None,
                    help="llama.cpp n_threads and n_threads_batch (default: the HF side's thread count)")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    spec = SMOKE if args.smoke else QUICK if args.quick else BenchSpec()
    if args.concurrency:
        spec = replace(spec, concurrency=tuple(args.concurrency))
    r = run(spec, args.checkpoint, llama_threads=args.llama_threads)
    return common.write_result(r, table(r), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
