"""Every CPU core: which layout of the embedded model uses a multi-core CPU host best, measured side by side.

Usage: python bench/cpu_cores.py [--reps N] [--layouts NAME ...] [--new-tokens N] [--before DIR] [--json OUT.json]

Each candidate runs in its own child process (the XLA CPU device count and XLA flags are fixed when JAX starts),
loaded and warmed up once, then the parent asks each in turn for one timed run - A B C ... A B C ... - so a drift
in the shared host's speed hits every candidate alike. Workload (the issue's): the embedded model in `serve`'s
formats (FP8 prefill, INT4 decode, FP8 KV), c prompts of 64 random token ids submitted at once, 32 new tokens
each, greedy, ignore_eos; tokens/s = generated tokens / wall seconds of the whole batch (prefill included).
Every rep draws new prompts (the prefix cache never hits), the same for every candidate in that rep.
Candidates: "1core" (one device, the process pinned to one core: the per-core baseline every ratio is taken
against), "1dev" (one device, every core: the default before this bench), "tp<N>" / "dp<N>" (N XLA CPU devices,
tensor parallel / DP attention), "workers<N>" (N engine replicas, one device each, behind the SessionRouter),
"eigen-off" (one device, XLA's multi-threaded Eigen off), "xnn" (one device, XNNPACK dots), "sched" (one device,
XLA:CPU's concurrency-optimized scheduler), "xnn-workers<N>" / "xnn-dp<N>" / "sched-xnn" (combinations). Host load
(/proc/loadavg) is recorded before and after; the host may be shared, so read the ratios to "1core".
Agreement: the share of rows whose greedy tokens equal "1dev"'s in the same rep. Busy: the candidate process's
CPU seconds (all threads) per wall second of a run, i.e. how many cores it kept busy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "cpu_cores.json"


@dataclass(frozen=True)
class Layout:
    """One candidate: devices (XLA CPU devices), sharding of one engine, workers (replicas, one device each),
    pin (the process runs on this many cores; None: all), xla_flags (extra XLA_FLAGS)."""

    devices: int = 1
    sharding: str = "tp"
    workers: int = 1
    pin: int | None = None
    xla_flags: str = ""
    root: str | None = None  # the jaxserve source tree the candidate runs (None: this one; `--before DIR`)


XNN = "--xla_cpu_use_xnnpack=true"
SCHED = "--xla_cpu_enable_concurrency_optimized_scheduler=true"


def layouts(cores: int, before: str | None = None) -> dict[str, Layout]:
    n = cores
    old = {} if before is None else {"before-1core": Layout(pin=1, root=before), "before-1dev": Layout(root=before)}
    return {**old, "1core": Layout(pin=1), "1dev": Layout(), f"tp{n}": Layout(devices=n),
            f"dp{n}": Layout(devices=n, sharding="dp_attention"), f"workers{n}": Layout(devices=n, workers=n),
            "eigen-off": Layout(xla_flags="--xla_cpu_multi_thread_eigen=false"),
            "xnn": Layout(xla_flags=XNN), f"xnn-workers{n}": Layout(devices=n, workers=n, xla_flags=XNN),
            f"xnn-dp{n}": Layout(devices=n, sharding="dp_attention", xla_flags=XNN),
            "sched": Layout(xla_flags=SCHED), "sched-xnn": Layout(xla_flags=f"{SCHED} {XNN}")}


def default_names(cores: int) -> tuple[str, ...]:
    """The candidates run by default (the combinations lost in a first run: --layouts names them)."""
    return (f"tp{cores}", f"dp{cores}", f"workers{cores}", "sched", "xnn")


@dataclass(frozen=True)
class Workload:
    prompt_len: int = 64
    new_tokens: int = 32
    concurrency: tuple[int, ...] = (1, 16)


# ---------------------------------------------------------------------------------------------------- child


def child(name: str, layout: Layout, wl: Workload) -> None:
    """Load, warm up, then answer one JSON line per request line on stdin: {"c", "seed"} -> {"s", "cpu_s",
    "tokens"} (wall and CPU seconds of the run, greedy tokens per row)."""
    if layout.pin is not None:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:layout.pin])  # before XLA sizes its thread pools
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {layout.xla_flags}".strip()
    import jax

    jax.config.update("jax_num_cpu_devices", layout.devices)
    sys.path.insert(0, layout.root or str(ROOT))
    from jaxserve.cli import default_checkpoint
    from jaxserve.engine import Engine, EngineConfig

    cfg = EngineConfig(devices=layout.devices // layout.workers, sharding=layout.sharding, max_queue=64)
    if layout.workers > 1:
        from jaxserve.engine.router import SessionRouter

        engine = SessionRouter.replicas(default_checkpoint(), cfg, layout.workers)
    else:
        engine = Engine.from_checkpoint(default_checkpoint(), cfg)
    vocab = engine.model_cfg.vocab_size
    for c in wl.concurrency:  # compile every shape the timed runs use (twice: the second run's buckets too)
        for seed in (-1, -2):
            generate(engine, prompts(c, wl.prompt_len, vocab, seed), wl.new_tokens)
    print(json.dumps({"ready": name, "devices": [str(d) for d in jax.devices()],
                      "affinity": sorted(os.sched_getaffinity(0))}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        tokens = generate(engine, prompts(ask["c"], wl.prompt_len, vocab, ask["seed"]), wl.new_tokens)
        print(json.dumps({"s": time.perf_counter() - t0, "cpu_s": cpu_seconds() - cpu0, "tokens": tokens}),
              flush=True)
    engine.close()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads."""
    t = os.times()
    return t.user + t.system


def prompts(c: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng([c, seed + 10])
    return rng.integers(1, vocab, size=(c, length)).tolist()


def generate(engine: object, rows: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Submit every row at once (Engine or SessionRouter), read every stream -> greedy tokens per row."""
    from jaxserve.engine import Request, SamplingParams

    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    streams = [engine.submit(Request(r, sp)) for r in rows]
    out = []
    for s in streams:
        evs = list(s)
        if any(e.error is not None for e in evs):
            raise next(e.error for e in evs if e.error is not None)
        out.append([e.token_id for e in evs if e.token_id is not None])
    return out


# ---------------------------------------------------------------------------------------------------- parent


class Candidate:
    """A child process serving timed runs over pipes."""

    def __init__(self, name: str, log: Path, wl: Workload, before: str | None) -> None:
        self.name = name
        self.log = log.open("w")
        root = layouts(os.cpu_count(), before)[name].root or str(ROOT)
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
        args = ["--child", name, "--new-tokens", str(wl.new_tokens)] + (["--before", before] if before else [])
        self.proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.info: dict = {}

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited before it was ready; see {self.log.name}")
        self.info = json.loads(line)

    def run(self, c: int, seed: int) -> dict:
        self.proc.stdin.write(json.dumps({"c": c, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} died mid-run; see {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def run(names: list[str], reps: int, wl: Workload, logdir: Path, before: str | None = None) -> dict:
    import statistics

    cands = []
    try:
        for n in names:  # started one at a time: concurrent start-ups (compiles) would only fight for the cores
            cands.append(Candidate(n, logdir / f"cpu_cores_{n}.log", wl, before))
            cands[-1].wait_ready()
        load_before = loadavg()
        times: dict[str, dict[int, list[float]]] = {n: {c: [] for c in wl.concurrency} for n in names}
        busy: dict[str, dict[int, list[float]]] = {n: {c: [] for c in wl.concurrency} for n in names}
        agree: dict[str, list[float]] = {n: [] for n in names}
        for rep in range(reps):
            for c in wl.concurrency:
                outs = {}
                for cand in cands:
                    r = cand.run(c, rep)
                    times[cand.name][c].append(c * wl.new_tokens / r["s"])
                    busy[cand.name][c].append(r["cpu_s"] / r["s"])
                    outs[cand.name] = r["tokens"]
                ref = outs.get("1dev")
                for n, toks in outs.items():
                    if ref is not None:
                        agree[n].append(sum(a == b for a, b in zip(toks, ref)) / len(ref))
        load_after = loadavg()
    finally:
        for cand in cands:
            cand.close()
    rows = {}
    for n in names:
        rows[n] = {"layout": vars(layouts(os.cpu_count(), before)[n]), "devices": cands[names.index(n)].info.get("devices"),
                   "affinity": cands[names.index(n)].info.get("affinity"),
                   "agreement_with_1dev": statistics.mean(agree[n]) if agree[n] else None}
        for c in wl.concurrency:
            xs = times[n][c]
            base = times["1core"][c] if "1core" in times else None
            rows[n][f"c{c}"] = {"tok_s": spread(xs), "over_1core": spread([x / b for x, b in zip(xs, base)])
                                if base else None, "cores_busy": spread(busy[n][c])}
    return {"workload": vars(wl), "reps": reps, "cores": os.cpu_count(), "loadavg_before": load_before,
            "loadavg_after": load_after, "layouts": rows}


def spread(xs: list[float]) -> dict:
    import statistics

    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def table(r: dict, concurrency: tuple[int, ...]) -> str:
    lines = [f"cores {r['cores']}, {r['reps']} interleaved reps, loadavg before {r['loadavg_before']} after "
             f"{r['loadavg_after']}",
             f"  {'layout':<12}" + "".join(f" {'c=' + str(c) + ' tok/s':>22} {'x 1core':>18} {'busy':>5}" for c in concurrency)
             + f" {'agree':>6}"]
    for n, row in r["layouts"].items():
        cells = ""
        for c in concurrency:
            t, q = row[f"c{c}"]["tok_s"], row[f"c{c}"]["over_1core"]
            cells += f" {t['median']:>7.0f} ({t['min']:>5.0f}..{t['max']:>5.0f})"
            cells += f" {q['median']:>5.2f} ({q['min']:.2f}..{q['max']:.2f})" if q else f" {'-':>18}"
            cells += f" {row[f'c{c}']['cores_busy']['median']:>5.2f}"
        a = row["agreement_with_1dev"]
        lines.append(f"  {n:<12}{cells} {a if a is None else f'{a:.2f}':>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layouts", nargs="+", default=None,
                    help="candidates (default: tp, dp, workers at the core count, sched, xnn; 1core and 1dev always run)")
    ap.add_argument("--json", dest="json_out", type=Path, default=RESULT)
    ap.add_argument("--new-tokens", type=int, default=Workload.new_tokens)
    ap.add_argument("--before", default=None, metavar="DIR",
                    help="a jaxserve source tree (e.g. `git archive` of an earlier commit): adds its candidates "
                         "before-1core and before-1dev, run interleaved with this tree's")
    args = ap.parse_args(argv)
    all_layouts = layouts(os.cpu_count(), args.before)
    wl = Workload(new_tokens=args.new_tokens)
    if args.child:
        child(args.child, all_layouts[args.child], wl)
        return 0
    names = list(dict.fromkeys(["1core", "1dev", *(args.layouts or default_names(os.cpu_count()))]))
    r = run(names, args.reps, wl, Path("/tmp"), args.before)
    sys.path.insert(0, str(ROOT))
    from bench import common

    r["machine"] = {"cpu": common.cpu_model(), "cores": os.cpu_count()}
    return common.write_result(r, table(r, wl.concurrency), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
