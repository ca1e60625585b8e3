"""The prefill/decode-servers comparison of bench/serving.py (`--pd P:D`): P `--role prefill` + D `--role decode`
servers behind a `jaxserve router`, against one `--role both` server with the same devices, on one host.

Devices: on CPU each PD process gets one host device (XLA_FLAGS=--xla_force_host_platform_device_count=1), the both
server P + D devices as `--workers P+D` data-parallel replicas (one device each): the same devices in all; every
process shares the host's cores (no pinning), so the two layouts get the same cores too. Both layouts start together
and stay up; each is warmed (the servers compile a shape on first use), then the passes run interleaved, layout by
layout, repetition by repetition: each concurrency of short streams, then the interference pass (the short streams
of the first concurrency while long prompts, e.g. 1,500 tokens and 1 new token, arrive at a fixed rate beside them;
only the short streams' ITL counts). Every pass records /proc/loadavg before and after: the host is shared.
Figures over repetitions are median, min and max. Goal (issue 34): the PD layout's short-stream ITL p99 with long
prompts <= 1.5x its ITL p99 without them (the same short workload's pass of that concurrency).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from bench import common
from bench import serving as sv

GOAL_RATIO = 1.5
START_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class PDSpec:
    """prefill/decode: server counts; concurrencies: the short-stream passes (short: their prompt/output lengths,
    requests per pass = max(short.num_requests, c)); reps: interleaved repetitions; the interference pass runs the
    short streams at concurrencies[0] beside long prompts (long_prompt_len tokens, long_max_tokens new) arriving
    every 1/long_rate s; warmup: the servers' --warmup level (our own warm-up passes run in any case)."""

    prefill: int = 1
    decode: int = 2
    concurrencies: tuple[int, ...] = (16, 64)
    short: sv.LoadSpec = sv.LoadSpec(prompt_len=(32, 96), output_len=(8, 16), num_requests=32, warmup_requests=0,
                                     max_seconds=180.0)
    reps: int = 3
    long_prompt_len: int = 1500
    long_max_tokens: int = 1
    long_rate: float = 0.5
    max_model_len: int = 2048
    warmup: str = "fast"


QUICK = PDSpec(reps=2, long_rate=2.0,
               short=replace(PDSpec.short, num_requests=64, output_len=(8, 12), max_seconds=120.0))
SMOKE = PDSpec(prefill=1, decode=1, concurrencies=(2,), reps=1, long_prompt_len=48, long_rate=2.0,
               max_model_len=256, warmup="none",
               short=sv.LoadSpec(prompt_len=(8, 16), output_len=(2, 4), num_requests=4, warmup_requests=0,
                                 max_seconds=60.0, source="random"))


def parse_pd(text: str) -> tuple[int, int]:
    """'P:D' -> (P, D), both >= 1."""
    m = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise SystemExit(f"--pd wants P:D with P, D >= 1 (prefill:decode servers), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (/proc/loadavg)."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# ---------------------------------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A jaxserve process, the loopback port it listens on, and its stderr log file."""

    proc: subprocess.Popen
    port: int
    log: Path


def launch(args: list[str], devices: int, log: Path) -> subprocess.Popen:
    """`jaxserve <args>` with `devices` host devices, stderr to `log`."""
    env = {**os.environ, "PYTHONPATH": str(sv.ROOT),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, "-m", "jaxserve.cli", *args], cwd=sv.ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True)


def wait_listening(proc: subprocess.Popen, log: Path) -> Proc:
    """Once the start-up line names the URL: (process, port); raises if it exits or START_TIMEOUT_S passes."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_TIMEOUT_S:
        m = re.search(r" on http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        if m:
            return Proc(proc, int(m.group(1)), log)
        if proc.poll() is not None:
            raise RuntimeError(f"jaxserve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.3)
    raise RuntimeError(f"jaxserve did not start within {START_TIMEOUT_S} s: {log.read_text()[-2000:]}")


def wait_ready(p: Proc) -> None:
    """Until GET /ready answers 200 (the server's own warm-up is done)."""
    sv.wait_ready(p.proc, p.port, p.log, START_TIMEOUT_S)


@dataclass
class Layout:
    """One layout's processes; `front` is the one clients talk to (the router, or the both server)."""

    name: str
    front: Proc
    procs: list[Proc]


def serve_args(ckpt: Path, spec: PDSpec, threads: int, role: str) -> list[str]:
    return ["serve", "--checkpoint", str(ckpt), "--host", "127.0.0.1", "--port", "0", "--threads", str(threads),
            "--max-model-len", str(spec.max_model_len), "--warmup", spec.warmup, "--role", role]


def start_layouts(ckpt: Path, spec: PDSpec, threads: int, tmp: Path) -> list[Layout]:
    """Start the PD servers and the both server together, then the router over the PD servers; wait until ready."""
    n = spec.prefill + spec.decode
    roles = ["prefill"] * spec.prefill + ["decode"] * spec.decode
    pending = [(launch(serve_args(ckpt, spec, threads, r), 1, tmp / f"pd_{r}{i}.log"), tmp / f"pd_{r}{i}.log")
               for i, r in enumerate(roles)]
    both_log = tmp / "both.log"
    both_cmd = [*serve_args(ckpt, spec, threads, "both"), "--workers", str(n)]
    pending.append((launch(both_cmd, n, both_log), both_log))
    procs: list[Proc] = []
    try:
        for proc, log in pending:
            procs.append(wait_listening(proc, log))
        for p in procs:
            wait_ready(p)
        urls = [f"http://127.0.0.1:{p.port}" for p in procs[:n]]
        router_log = tmp / "router.log"
        router_cmd = ["router", "--checkpoint", str(ckpt), "--host", "127.0.0.1", "--port", "0", "--threads",
                      str(threads), "--prefill", *urls[:spec.prefill], "--decode", *urls[spec.prefill:]]
        router = wait_listening(launch(router_cmd, 1, router_log), router_log)
        procs.append(router)
        wait_ready(router)
    except BaseException:
        for proc, _ in pending:
            proc.kill()
        for p in procs[n + 1:]:
            p.proc.kill()
        raise
    return [Layout(f"pd {spec.prefill}:{spec.decode}", router, [router, *procs[:n]]),
            Layout(f"both x{n}", procs[n], [procs[n]])]


def stop_layouts(layouts: list[Layout]) -> None:
    for lay in layouts:
        for p in lay.procs:  # router first: it stops routing before its servers go
            sv.stop_server(p.proc)


# ---------------------------------------------------------------------------------------------------- passes


def long_requests(spec: PDSpec, n: int, vocab: int, seed: int, stream: np.ndarray | None
                  ) -> list[tuple[list[int], int]]:
    """n long prompts of exactly long_prompt_len tokens, long_max_tokens each."""
    ls = replace(spec.short, prompt_len=(spec.long_prompt_len,) * 2, output_len=(spec.long_max_tokens,) * 2)
    return sv.workload(ls, n, vocab, seed, stream)


def interference(port: int, model: str, short: list, longs: list, spec: PDSpec, c: int, seed: int
                 ) -> tuple[list[sv.Result], float, list[sv.Result]]:
    """The short streams at concurrency c while long prompts arrive every 1/long_rate s until the short pass ends
    -> (short results, short seconds, long results)."""
    stop = threading.Event()
    long_results: list[sv.Result] = []
    t_base = time.perf_counter()

    def feeder() -> None:
        threads = []
        for i, (prompt, n) in enumerate(longs):
            if stop.wait(timeout=max(0.0, t_base + i / spec.long_rate - time.perf_counter())):
                break
            t = threading.Thread(target=lambda p=prompt, k=n: long_results.append(sv.one_request(
                "127.0.0.1", port, model, p, k, t_base, spec.short.request_timeout)), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(spec.short.request_timeout)

    f = threading.Thread(target=feeder, daemon=True)
    f.start()
    results, seconds = sv.run_pass("127.0.0.1", port, model, short, replace(spec.short, concurrency=c, rate=None),
                                   seed, f"c{c}+long")
    stop.set()
    f.join()
    return results, seconds, list(long_results)


def measure(lay: Layout, model: str, kind: str, reqs: list, longs: list, spec: PDSpec, rep: int) -> dict:
    """One pass of `kind` ("c16", or "c16+long") on `lay` -> its summary with the host load around it."""
    c = int(kind[1:].split("+")[0])
    before = loadavg()
    if kind.endswith("+long"):
        res, secs, lres = interference(lay.front.port, model, reqs, longs, spec, c, spec.short.seed + rep)
        extra = {"long": sv.summarize(lres, secs, len(lres))}
    else:
        res, secs = sv.run_pass("127.0.0.1", lay.front.port, model, reqs,
                                replace(spec.short, concurrency=c, rate=None), spec.short.seed + rep, kind)
        extra = {}
    return {"layout": lay.name, "kind": kind, "rep": rep, "loadavg_before": before, "loadavg_after": loadavg(),
            "summary": sv.summarize(res, secs, len(reqs)), **extra}


def warm(lay: Layout, model: str, spec: PDSpec, vocab: int, stream: np.ndarray | None) -> None:
    """Untimed: each concurrency's shapes twice (replicas each compile what their share of a pass needs), long
    prompts at once on every replica, then a few beside short streams."""
    for i, c in enumerate(spec.concurrencies * 2):
        reqs = sv.workload(spec.short, max(c, spec.short.num_requests), vocab, 1000 + i, stream)
        sv.run_pass("127.0.0.1", lay.front.port, model, reqs, replace(spec.short, concurrency=c, rate=None),
                    0, f"warm {lay.name} c{c}")
    n = 2 * (spec.prefill + spec.decode)  # at once, so every replica of the both server compiles the long prefill
    sv.run_pass("127.0.0.1", lay.front.port, model, long_requests(spec, n, vocab, 2001, stream),
                replace(spec.short, concurrency=n, rate=None), 0, f"warm {lay.name} long")
    c = spec.concurrencies[0]
    short = sv.workload(spec.short, max(c, spec.short.num_requests), vocab, 2000, stream)
    interference(lay.front.port, model, short, long_requests(spec, 4, vocab, 2002, stream), spec, c, 0)


# ---------------------------------------------------------------------------------------------------- summary


def spread_of(passes: list[dict], get) -> dict | None:  # noqa: ANN001 - a one-line accessor
    xs = [get(p) for p in passes]
    xs = [x for x in xs if x is not None]
    return common.spread(xs) if xs else None


def aggregate(passes: list[dict], layouts: list[str], kinds: list[str]) -> dict:
    """Per layout and pass kind: median/min/max over repetitions of throughput, TTFT and ITL p50/p99; errors."""
    out: dict = {}
    for lay in layouts:
        for kind in kinds:
            ps = [p for p in passes if p["layout"] == lay and p["kind"] == kind]
            out.setdefault(lay, {})[kind] = {
                "output_tokens_per_s": spread_of(ps, lambda p: p["summary"]["output_tokens_per_s"]),
                "ttft_p50_ms": spread_of(ps, lambda p: p["summary"]["ttft"]["p50_ms"]),
                "ttft_p99_ms": spread_of(ps, lambda p: p["summary"]["ttft"]["p99_ms"]),
                "itl_p50_ms": spread_of(ps, lambda p: p["summary"]["itl"]["p50_ms"]),
                "itl_p99_ms": spread_of(ps, lambda p: p["summary"]["itl"]["p99_ms"]),
                "errors": sum(p["summary"]["errors"] + p.get("long", {}).get("errors", 0) for p in ps),
                "completed": sum(p["summary"]["completed"] for p in ps)}
    return out


def interference_ratios(agg: dict, c: int) -> dict:
    """Per layout: median ITL p99 of the short streams with long prompts over without, and the goal's verdict."""
    out = {}
    for lay, kinds in agg.items():
        w, wo = kinds[f"c{c}+long"]["itl_p99_ms"], kinds[f"c{c}"]["itl_p99_ms"]
        ratio = w["median"] / wo["median"] if w and wo and wo["median"] > 0 else None
        out[lay] = {"itl_p99_with_long_ms": w and w["median"], "itl_p99_without_ms": wo and wo["median"],
                    "ratio": ratio, "goal": GOAL_RATIO,
                    "goal_met": None if ratio is None else ratio <= GOAL_RATIO}
    return out


def run_pd(spec: PDSpec, checkpoint: Path | None) -> dict:
    """Start both layouts, warm them, run the interleaved passes -> the result document."""
    import tempfile

    from tools.train_tiny import ModelSize

    vocab = ModelSize().vocab_size
    stream = sv.corpus_tokens() if spec.short.source == "corpus" else None
    kinds = [f"c{c}" for c in spec.concurrencies] + [f"c{spec.concurrencies[0]}+long"]
    threads = max(64, 2 * max(spec.concurrencies)) + 8
    passes: list[dict] = []
    load_start = loadavg()
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        ckpt, model_desc = sv.bench_checkpoint(checkpoint, tmp)
        t0 = time.monotonic()
        layouts = start_layouts(ckpt, spec, threads, tmp)
        start_s = time.monotonic() - t0
        try:
            name = sv.get_json("127.0.0.1", layouts[0].front.port, "/v1/models")["data"][0]["id"]
            for lay in layouts:
                warm(lay, name, spec, vocab, stream)
            n_long = int(spec.short.max_seconds * spec.long_rate) + 1
            for rep in range(spec.reps):
                for k, kind in enumerate(kinds):
                    c = int(kind[1:].split("+")[0])
                    reqs = sv.workload(spec.short, max(c, spec.short.num_requests), vocab, 100 * rep + k, stream)
                    longs = long_requests(spec, n_long, vocab, 100 * rep + 50, stream)
                    for lay in layouts if rep % 2 == 0 else layouts[::-1]:  # alternate who goes first
                        passes.append(measure(lay, name, kind, reqs, longs, spec, rep))
        finally:
            stop_layouts(layouts)
    agg = aggregate(passes, [lay.name for lay in layouts], kinds)
    return {"bench": "serving_pd", "model": model_desc, "served_model": name, "machine": common.machine(),
            "spec": asdict(spec), "layouts": {lay.name: layout_desc(lay.name, spec) for lay in layouts},
            "start_s": start_s, "loadavg_start": load_start, "loadavg_end": loadavg(), "passes": passes,
            "summary": agg, "interference": interference_ratios(agg, spec.concurrencies[0]),
            "notes": f"client, router and servers on one shared CPU host ({os.cpu_count()} cores, other jobs running:"
                     " see the loadavg fields); warm-up passes excluded; median [min..max] over repetitions"}


def layout_desc(name: str, spec: PDSpec) -> str:
    n = spec.prefill + spec.decode
    if name.startswith("pd"):
        return (f"{spec.prefill} --role prefill + {spec.decode} --role decode processes (1 CPU device each) behind "
                "a jaxserve router")
    return f"one --role both process, --workers {n} (one CPU device each, {n} devices)"


def table(r: dict) -> str:
    def cell(d: dict | None) -> str:
        return "-" if d is None else f"{d['median']:.0f} [{d['min']:.0f}..{d['max']:.0f}]"

    cols = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    lines = [f"serving_pd {r['served_model']}: {r['spec']['reps']} interleaved reps, median [min..max]; "
             f"load {r['loadavg_start']} -> {r['loadavg_end']} on {r['machine']['cores']} cores",
             f"  {'layout':<10} {'pass':<9} " + " ".join(f"{c:>20}" for c in ("tok/s", "TTFT p50 ms",
                                                                              "TTFT p99 ms", "ITL p50 ms",
                                                                              "ITL p99 ms")) + "  errors"]
    for lay, kinds in r["summary"].items():
        for kind, d in kinds.items():
            lines.append(f"  {lay:<10} {kind:<9} " + " ".join(f"{cell(d[c]):>20}" for c in cols)
                         + f"  {d['errors']}")
    for lay, i in r["interference"].items():
        ratio = "-" if i["ratio"] is None else f"{i['ratio']:.2f}x"
        n = sum(p["long"]["completed"] for p in r["passes"] if p["layout"] == lay and "long" in p)
        lines.append(f"  {lay}: ITL p99 with long prompts / without = {ratio} (goal <= {GOAL_RATIO}x: "
                     f"{'met' if i['goal_met'] else 'not met'}; {n} long prompts of {r['spec']['long_prompt_len']} "
                     f"tokens answered in {r['spec']['reps']} reps)")
    return "\n".join(lines)


def main(pd: str, preset: str, checkpoint: Path | None, reps: int | None, json_out: Path) -> int:
    """`bench/serving.py --pd P:D [--quick | --smoke] [--reps N]`."""
    p, d = parse_pd(pd)
    spec = {"smoke": SMOKE, "quick": QUICK}.get(preset, PDSpec())
    spec = replace(spec, prefill=p, decode=d, reps=reps or spec.reps)
    r = run_pd(spec, checkpoint)
    return common.write_result(r, table(r), json_out)
