"""Where `--warmup fast`'s first requests lose time, as bench/fast_first_request.py sets them up (the embedded model,
`serve --max-model-len 256`'s engine config, the user's compile cache, `warm_up("fast")`), each part in its own
process. "background": no requests; the background thread released for `--seconds`: what its worker spent in
tracing, lowering and backend compile / cache retrieval (`jax.monitoring` durations on that thread), and the CPU
ticks of every thread of the process with its nice value (/proc/self/task/*/stat). "first": the background held;
`--requests` lone requests (87-token prompt, 32 tokens), the engine thread sampled every 2 ms: samples in all and
waiting for the device (`read_decode`, `run_prefill`); "first_primed": the same after one 5-token, 2-token request.

Usage: python bench/fast_background_profile.py [--seconds 10] [--requests 3] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

_RUN = """
import collections, json, os, sys, threading, time, jax
from jaxserve.cli import build_parser, default_checkpoint
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.compile_cache import enable_from_args
from jaxserve.server.main import engine_config
part, n = sys.argv[1], float(sys.argv[2])
args = build_parser().parse_args(["serve", "--max-model-len", "256"])
enable_from_args(args)
engine = Engine.from_checkpoint(default_checkpoint(), engine_config(args))
hold = threading.Event()
engine.warm_up("fast", hold=hold)
def ticks():
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        s = open(f"/proc/self/task/{tid}/stat").read()
        r = s[s.rindex(")") + 2:].split()
        out[tid] = (names.get(int(tid), s[s.index("(") + 1:s.rindex(")")]), int(r[16]), int(r[11]) + int(r[12]))
    return out
if part == "background":
    dur = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, s, **_: dur.update({e: s}) if threading.current_thread().name.startswith("jaxserve-warmup") else None)
    before, done0 = ticks(), len(engine.scheduler.shapes.done)
    hold.set()
    time.sleep(n)
    after, grouped = ticks(), collections.Counter()
    for tid, (name, nice, t) in after.items():
        if t - before.get(tid, (0, 0, 0))[2] > 0:
            grouped[f"{name} (nice {nice})"] += t - before.get(tid, (0, 0, 0))[2]
    out = {"keys_compiled": len(engine.scheduler.shapes.done) - done0, "seconds": n,
           "worker_event_s": {k: round(v, 3) for k, v in dur.items()}, "cpu_ticks_by_thread": dict(grouped)}
else:
    tid = next(t.ident for t in threading.enumerate() if t.name == "jaxserve-engine")
    def sample(stop, got):
        while not stop.is_set():
            f, names = sys._current_frames().get(tid), set()
            while f is not None:
                names.add(f.f_code.co_name); f = f.f_back
            got["samples"] += 1
            got["device_wait"] += bool(names & {"read_decode", "run_prefill"})
            time.sleep(0.002)
    if part == "first_primed":
        engine.generate([[11, 12, 13, 14, 15]], SamplingParams(max_tokens=2, ignore_eos=True, temperature=1.0))
    out = {"requests": []}
    for i in range(int(n)):
        stop, got = threading.Event(), collections.Counter()
        th = threading.Thread(target=sample, args=(stop, got)); th.start(); t0 = time.monotonic()
        engine.generate([[(31 * j + i) % 4000 + 10 for j in range(87)]],
                        SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0))
        out["requests"].append({"seconds": round(time.monotonic() - t0, 3), **got}); stop.set(); th.join()
engine.close()
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    out: dict = {"bench": "fast_background_profile", "command": "python bench/fast_background_profile.py " +
                 " ".join(sys.argv[1:] if argv is None else argv), "machine": common.machine()}
    for part, n in (("background", args.seconds), ("first", args.requests), ("first_primed", args.requests)):
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, "-c", _RUN, part, str(n)], cwd=ROOT, check=True,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out[part] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": load,
                     "load_after": os.getloadavg()[0]}
    text = json.dumps({k: out[k] for k in ("background", "first", "first_primed")}, indent=1)
    return common.write_result(out, text, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
