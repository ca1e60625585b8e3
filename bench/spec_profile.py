"""Where a speculative decode step's time goes on this host: one c = 1 request on the embedded model (64-token
prompt, greedy), plain decode vs "ngram:K" / "mtp:K" speculation.

Usage: python bench/spec_profile.py [--k 3] [--steps 40] [--json bench/results/spec_profile.json]
       python bench/spec_profile.py --program-rows 1,16 [--methods plain,ngram]   (programs only, R rows each)
       python bench/spec_profile.py --program-rows 1 --ops [--methods plain,ngram]   (programs' op-level trace)

Per engine (plain, ngram:K, mtp:K; the serving `EngineConfig()` otherwise, no prefix cache), after an untimed pass
that compiles its shapes:
- step: the wall time of one `Engine.step()` in steady decode (median and min..max over --steps steps), tokens it
  emitted, and so the ms per emitted token; traces (compiles) during the timed steps (a retrace shows here);
- program: the device program alone, called back to back on the same steady-state arguments and blocked on
  (decode at B = 1; verify over k + 1 positions; the MTP verify with its k - 1 chained draft steps), and the
  same with `jax.jit`'s dispatch measured separately (time to return before the result is ready);
- phases of a speculative step, timed by wrapping the scheduler's methods in this process only (the hot path has no
  timers): host work before the verify (drafts, pages, batch, sampling arrays), the verify call to its
  host copies, host work after (acceptance, rollback, page bookkeeping); host_ms_per_step: the speculative
  steps' time less their verify programs', over the whole run.
--program-rows R1,R2: only the device program (as "program" above) with R requests decoding at once, for each R:
the decode program at R rows against the verify at R rows x (k + 1) positions (ngram's chained verifies included:
the program is the same, only its inputs are made on the device).
--ops (with --program-rows): instead of timing, a `jax.profiler` trace of --steps back-to-back calls of each program:
every XLA:CPU thunk's self time per call (fusions, dots, copies; loop bodies per trip), grouped by the model part
its HLO came from (bench/decode_profile.py's rules) and by kind, the top ops, ops per call, and the wall time per
call outside any op (no thunk running on any thread: dispatch, waits for XLA's threads), threads and hand-offs.
Tracing adds per-thunk overhead (a traced call is ~2x an untraced one here): read shares, not absolute times.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.speculative import CKPT, prompts_for  # noqa: E402
from jaxserve.engine import Engine, EngineConfig, Request, SamplingParams  # noqa: E402
from jaxserve.engine.config import Speculative  # noqa: E402
from jaxserve.engine.request import Status  # noqa: E402


def spread(xs: list[float]) -> dict:
    return {"median": float(np.median(xs)), "min": float(min(xs)), "max": float(max(xs)), "n": len(xs)}


def run_once(engine: Engine, prompt: list[int], new: int) -> None:
    engine.submit(Request(prompt, SamplingParams(max_tokens=new, ignore_eos=True)))
    while engine.scheduler.has_work():
        engine.step()


class Timer:
    """Wraps `obj.name` (an instance attribute shadowing the method) to add its wall time to `self.ms[key]`."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}

    def wrap(self, obj: object, name: str, key: str, block: bool = False) -> None:
        fn = getattr(obj, name)

        def timed(*args: object):
            t0 = time.perf_counter()
            out = fn(*args)
            if block:
                jax.block_until_ready(out)
            self.ms.setdefault(key, []).append((time.perf_counter() - t0) * 1e3)
            return out
        setattr(obj, name, timed)


def steps(engine: Engine, prompt: list[int], n: int, new: int) -> tuple[list[float], list[int], int]:
    """Submit one request, step to steady decode, then time n steps -> (ms per step, tokens per step, traces)."""
    sched = engine.scheduler
    stream = engine.submit(Request(prompt, SamplingParams(max_tokens=new, ignore_eos=True)))
    while not any(s.status is Status.DECODING for s in sched.running):
        engine.step()
    for _ in range(3):
        engine.step()
    seq = next(s for s in sched.running if s.status is Status.DECODING)
    traces0 = sum(engine.scheduler.programs.compiles.values())
    ms, toks = [], []
    for _ in range(n):
        before = len(seq.generated)
        t0 = time.perf_counter()
        engine.step()
        ms.append((time.perf_counter() - t0) * 1e3)
        toks.append(len(seq.generated) - before)
        if seq.status is not Status.DECODING:
            break
    traces = sum(engine.scheduler.programs.compiles.values()) - traces0
    while sched.has_work():
        engine.step()
    list(stream)
    return ms, toks, traces


def capture_program(engine: Engine, prompts: list[list[int]], new: int) -> tuple[object, str, tuple]:
    """Step `prompts` (decoding together) to a steady step and capture its device program's arguments
    -> (the jitted program, its name, the arguments after (params, pages))."""
    prog = engine.scheduler.programs
    captured: dict[str, tuple] = {}
    spec = engine.scheduler._speculation
    if spec is None:
        target, attr = prog, "_decode"
    elif spec.mtp is not None:
        target, attr = prog.mtp, "_verify"
    else:
        target, attr = prog, "_verify"
    fn = getattr(target, attr)

    def capture(params, pages, *rest):
        captured.setdefault("args", rest)
        return fn(params, pages, *rest)
    setattr(target, attr, capture)
    for prompt in prompts:
        engine.submit(Request(prompt, SamplingParams(max_tokens=new, ignore_eos=True)))
    while "args" not in captured or not any(s.status is Status.DECODING for s in engine.scheduler.running):
        engine.step()
    for _ in range(4):  # a steady step's arguments (drafts present)
        captured.pop("args", None)
        while "args" not in captured:
            engine.step()
    setattr(target, attr, fn)
    return fn, attr, captured["args"]


def call(engine: Engine, fn: object, rest: tuple) -> tuple:
    """One call of the captured program on the decode pool (threaded through, as the engine does)."""
    ph = engine.scheduler.programs.decode_phase
    out = fn(ph.params, ph.pages, *rest)
    ph.pages = out[2]
    return out


def program_times(engine: Engine, prompts: list[list[int]], reps: int, new: int) -> dict:
    """The device program of a steady decode step of `prompts` (decoding together) alone: capture its arguments,
    call it back to back."""
    fn, attr, rest = capture_program(engine, prompts, new)
    total, dispatch = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = call(engine, fn, rest)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        dispatch.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    while engine.scheduler.has_work():
        engine.step()
    return {"program": attr, "ms": spread(total), "dispatch_ms": spread(dispatch)}


def busy(pd: jax.profiler.ProfileData, steps: int) -> dict:
    """Per step: the union of every XLA thread's thunk intervals (us: some thunk running somewhere), the threads that
    ran thunks, and the hand-offs (consecutive thunks, by start, on different threads)."""
    evs = sorted((e.start_ns, e.start_ns + e.duration_ns, line.name) for plane in pd.planes for line in plane.lines
                 if line.name != "python" for e in line.events
                 if not e.name.startswith(("ThunkExecutor", "ThreadpoolListener")))
    union, end, handoffs, prev = 0, 0, 0, None
    for start, stop, thread in evs:
        union += max(0, stop - max(start, end))
        end = max(end, stop)
        handoffs += prev is not None and thread != prev
        prev = thread
    return {"union_us": union / 1e3 / steps, "threads": len({t for _, _, t in evs}), "handoffs": handoffs / steps}


def op_profile(engine: Engine, prompts: list[list[int]], steps: int, new: int) -> dict:
    """--ops: a `jax.profiler` trace of `steps` back-to-back calls of the captured program: each thunk's self time
    per step (bench/decode_profile.thunk_times), its model part (HloFrames), and the wall time per call outside any
    thunk (dispatch, waits for XLA's threads)."""
    from jax._src.lib import _profiler

    from bench.decode_profile import HloFrames, kind_of, thunk_times

    fn, attr, rest = capture_program(engine, prompts, new)
    ph = engine.scheduler.programs.decode_phase
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), ph.pages)
    frames = HloFrames(fn.lower(ph.params, spec, *rest).compile().as_text())
    for _ in range(5):
        jax.block_until_ready(call(engine, fn, rest))
    session = _profiler.ProfilerSession()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(call(engine, fn, rest))
        walls.append((time.perf_counter() - t0) * 1e6)
    wall_us = float(np.mean(walls))
    pd = jax.profiler.ProfileData.from_serialized_xspace(session.stop())
    while engine.scheduler.has_work():
        engine.step()
    per = thunk_times(pd, steps)
    groups: dict[str, list[float]] = {}
    kinds: dict[str, list[float]] = {}
    for name, (us, n) in per.items():
        for table, key in ((groups, frames.group(name)), (kinds, kind_of(name))):
            acc = table.setdefault(key, [0.0, 0.0])
            acc[0] += us
            acc[1] += n
    b = busy(pd, steps)

    def ranked(table: dict[str, list[float]]) -> dict:
        return {k: {"us": u, "ops": n} for k, (u, n) in sorted(table.items(), key=lambda kv: -kv[1][0])}
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:60]
    # a late thread wake-up shows in the mean: outside_median_us takes the median call against the mean busy time
    return {"program": attr, "wall_us_per_call": wall_us, "wall_us": spread(walls),
            "outside_median_us": float(np.median(walls)) - b["union_us"], "ops_per_call": sum(n for _, n in per.values()),
            "op_self_us": sum(u for u, _ in per.values()), "busy_us": b["union_us"],
            "outside_us": wall_us - b["union_us"], "threads": b["threads"], "handoffs_per_call": b["handoffs"],
            "hlo_instructions": len(frames.inst), "groups": ranked(groups), "kinds": ranked(kinds),
            "top": [{"op": n, "us": u, "per_call": k, "shape": frames.inst.get(n, ("",))[0],
                     "group": frames.group(n)} for n, (u, k) in top]}


def ops_lines(name: str, r: int, p: dict, load: tuple[float, float]) -> list[str]:
    lines = [f"{name:>6} rows {r:>2}: {p['program']} {p['wall_us_per_call']:.0f} us/call traced (median {p['wall_us']['median']:.0f}), "
             f"{p['ops_per_call']:.0f} ops ({p['op_self_us']:.0f} us self), busy {p['busy_us']:.0f} us, outside any "
             f"op {p['outside_us']:.0f} us (median call {p['outside_median_us']:.0f}), {p['threads']} threads, {p['handoffs_per_call']:.0f} hand-offs/call; "
             f"load {load[0]:.1f}->{load[1]:.1f}"]
    lines += [f"    {g:<26} {v['us']:>7.0f} us {v['ops']:>6.1f} ops" for g, v in p["groups"].items()]
    lines += [f"    kind {g:<21} {v['us']:>7.0f} us {v['ops']:>6.1f} ops" for g, v in p["kinds"].items()]
    lines += [f"    {t['op']:<30} {t['us']:>7.0f} us x{t['per_call']:.0f} {t['shape'][:30]:<30} {t['group']}"
              for t in p["top"][:12]]
    return lines


def phases(engine: Engine, prompt: list[int], n: int, new: int) -> dict:
    """A speculative step's phases, by wrapping the scheduler's parts on this engine object only."""
    sched, spec = engine.scheduler, engine.scheduler._speculation
    t = Timer()
    prog = sched.programs.mtp if spec.mtp is not None else sched.programs
    t.wrap(prog, "_verify", "program_ms", block=True)  # the jitted verify, to its outputs (read at once anyway)
    t.wrap(prog, "run_verify", "verify_call_ms")  # upload + program + host copies
    t.wrap(spec, "_drafts", "drafts_ms")
    t.wrap(spec, "_emit", "emit_ms")
    t.wrap(spec, "_verify", "verify_phase_ms")  # batch + sampling arrays + verify call + acceptance loop
    t.wrap(spec, "step", "spec_step_ms")
    t.wrap(sched.programs, "sync_tags", "sync_tags_ms")
    steps(engine, prompt, n, new)
    out = {key: spread(v) for key, v in t.ms.items()}
    # every speculative step of the run against every verify program in it: the host's share of a step
    out["host_ms_per_step"] = (sum(t.ms["spec_step_ms"]) - sum(t.ms["program_ms"])) / len(t.ms["spec_step_ms"])
    return out


def program_rows(args: argparse.Namespace, rows: list[int]) -> int:
    """--program-rows: each method's decode / verify program at each row count, engines built in turn."""
    out = {"bench": "spec_profile_ops" if args.ops else "spec_profile_rows", "machine": common.machine(), "k": args.k,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}
    lines = []
    for name in args.methods.split(","):
        cfg = EngineConfig(prefix_cache=False, speculative=None if name == "plain" else Speculative(name, args.k, None))
        engine = Engine.from_checkpoint(CKPT, cfg, start=False)
        for r in rows:
            load0 = os.getloadavg()
            prompts = prompts_for(engine, r, seed=1)
            if args.ops:
                p = op_profile(engine, prompts, args.steps, args.new_tokens)
                out["rows"].append({"engine": name, "decoding_rows": r, "ops": p, "loadavg_start": load0,
                                    "loadavg_end": os.getloadavg()})
                lines += ops_lines(name, r, p, (load0[0], os.getloadavg()[0]))
                print("\n".join(lines[-1 - len(p["groups"]) - len(p["kinds"]) - 12:]), flush=True)
                continue
            p = program_times(engine, prompts, args.steps, args.new_tokens)
            out["rows"].append({"engine": name, "decoding_rows": r, "program": p, "loadavg_start": load0,
                                "loadavg_end": os.getloadavg()})
            lines.append(f"{name:>6} rows {r:>2}: {p['program']} {p['ms']['median']:.2f} ms ({p['ms']['min']:.2f}.."
                         f"{p['ms']['max']:.2f}), load {load0[0]:.1f}->{os.getloadavg()[0]:.1f}")
            print(lines[-1], flush=True)
    return common.write_result(out, "\n".join(lines), args.json)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="plain,ngram,mtp")
    ap.add_argument("--program-rows", default=None, help="R1,R2: only the programs at R decoding rows each")
    ap.add_argument("--ops", action="store_true", help="with --program-rows: an op-level trace of each program")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "spec_profile.json")
    args = ap.parse_args()
    if args.program_rows:
        return program_rows(args, [int(r) for r in args.program_rows.split(",")])
    cfg = EngineConfig(prefix_cache=False)
    out = {"bench": "spec_profile", "machine": common.machine(), "k": args.k, "rows": []}
    lines = []
    for name in args.methods.split(","):
        c = cfg if name == "plain" else replace(cfg, speculative=Speculative(name, args.k))
        engine = Engine.from_checkpoint(CKPT, c, start=False)
        prompt = prompts_for(engine, 1, seed=1)[0]
        run_once(engine, prompt, args.new_tokens)  # compiles
        load0 = os.getloadavg()
        ms, toks, traces = steps(engine, prompt, args.steps, args.new_tokens)
        row = {"engine": name, "step_ms": spread(ms), "tokens_per_step": float(np.mean(toks)),
               "ms_per_token": float(sum(ms) / max(sum(toks), 1)), "traces_in_timed_steps": traces,
               "program": program_times(engine, [prompt], args.steps, args.new_tokens)}
        if name != "plain":
            row["phases"] = phases(engine, prompt, args.steps, args.new_tokens)
        row["loadavg_start"], row["loadavg_end"] = load0, os.getloadavg()
        out["rows"].append(row)
        p = row["program"]
        lines.append(f"{name:>6}: step {row['step_ms']['median']:.2f} ms ({row['step_ms']['min']:.2f}.."
                     f"{row['step_ms']['max']:.2f}), {row['tokens_per_step']:.2f} tok/step, "
                     f"{row['ms_per_token']:.2f} ms/tok, traces {traces}; program {p['program']} "
                     f"{p['ms']['median']:.2f} ms (dispatch {p['dispatch_ms']['median']:.2f}); load "
                     f"{load0[0]:.1f}->{row['loadavg_end'][0]:.1f}")
        for key, v in row.get("phases", {}).items():
            if not isinstance(v, dict):
                lines.append(f"        {key:<16} {v:.2f} ms")
                continue
            lines.append(f"        {key:<16} {v['median']:.2f} ms ({v['min']:.2f}..{v['max']:.2f}) x{v['n']}")
    return common.write_result(out, "\n".join(lines), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
