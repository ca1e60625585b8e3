"""Is there a first-execution cost? After `warm_up("fast")` (the embedded model, `serve --max-model-len 256`'s engine
config and CPU layout, the user's compile cache; the background compiles held so they do not disturb the timings),
in a fresh process each:

  * "programs": each program a lone short request runs (`fallback.lone_shapes` in both sampling forms, and the
    hand-off of its pages) called `--calls` times on all-padding data through the scheduler's own entry points
    (`engine.priming.run_once`, wall time incl. the upload and the wait for the result): first, second and the
    median of the rest, in ms, with the warm-up's own priming switched off (compiles only, as before it).
  * "requests": `--requests` lone requests one after another (a 64-token prompt, 1 greedy token: about a TTFT),
    end to end through `Engine.generate`, warm-up without priming; "requests_primed": the warm-up as shipped (it
    runs the fast set once: its line says how long); "requests_started": also serve's start-up request
    (`server.main.first_request`) before; "requests_idle": as "requests_started" with the engine idle 2 s before
    each request (a sweep starts after an idle gap); "http": as "requests_started", through the server app (Flask
    test client, no socket: a streamed chat completion of ~64 tokens of user text, 1 token).

Usage: python bench/first_execution.py [--calls 8] [--requests 6] [--modes programs,requests,...] --json OUT.json
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
import json, statistics, sys, threading, time
from jaxserve.cli import build_parser, default_checkpoint
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.compile_cache import enable_from_args
from jaxserve.engine.fallback import lone_shapes
from jaxserve.engine.priming import run_once, runnable
from jaxserve.engine.sampling_forms import SERVING_MODES
from jaxserve.engine import engine as engine_module
from jaxserve.server.main import engine_config, first_request, start_jax
mode, calls, requests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode in ("programs", "requests"):  # the warm-up as before priming: compiles only
    engine_module.prime = lambda *_: None
args = build_parser().parse_args(["serve", "--max-model-len", "256"])
enable_from_args(args)
engine = Engine.from_checkpoint(default_checkpoint(), engine_config(args, start_jax(args)))
line = engine.warm_up("fast", hold=threading.Event()).line()
c, order = engine.cfg, {"prefill": 0, "handoff": 1, "decode": 2, "verify": 3}
keys = sorted([(*s, f) for s in lone_shapes(engine.programs) for f in SERVING_MODES]
              + [("handoff", 0, c.prefill_page_buckets[0], 0, "")], key=lambda k: (order[k[0]], k[2], k[4]))
keys = [k for k in keys if runnable(engine.programs, k)]
out = {"warmup": line}
def timed(fn):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3
with engine._step_lock:
    if mode == "programs":
        for key in keys:
            ms = [timed(lambda: run_once(engine.programs, key, engine.scheduler.ranks)) for _ in range(calls)]
            out["/".join(map(str, key))] = {"first": ms[0], "second": ms[1], "median_rest": statistics.median(ms[2:])}
if mode in ("requests_started", "requests_idle", "http"):  # and serve's start-up request
    out["first_request_ms"] = timed(lambda: first_request(engine))
if mode == "http":  # the same lone request through the app (chat template, parsing, SSE), no socket
    from jaxserve.server.app import create_app
    client = create_app(engine, "tiny").test_client()
    text = " ".join(f"w{j}" for j in range(48))
    def chat(i):
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"{i} {text}"}], "max_tokens": 1,
                "stream": True}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.get_data(as_text=True).rstrip().endswith("[DONE]")
    out["request_ms"] = [timed(lambda: chat(i)) for i in range(requests)]
elif mode != "programs":
    idle = 2.0 if mode == "requests_idle" else 0.0
    def lone(i):
        time.sleep(idle)
        return timed(lambda: engine.generate([[(31 * j + i) % 4000 + 10 for j in range(64)]],
                                             SamplingParams(max_tokens=1)))
    out["request_ms"] = [lone(i) for i in range(requests)]
engine.close()
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--modes", default="programs,requests,requests_primed,requests_started,requests_idle,http")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    out: dict = {"bench": "first_execution", "command": "python bench/first_execution.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": common.machine()}
    lines = []
    for mode in args.modes.split(","):
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, "-c", _RUN, mode, str(args.calls), str(args.requests)], cwd=ROOT,
                              check=True, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # its stderr: the log
        res = out[mode] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": load,
                           "load_after": os.getloadavg()[0]}
        if mode == "programs":
            lines += [f"{k:<28} first {v['first']:7.1f}  second {v['second']:6.1f}  median {v['median_rest']:6.1f} ms"
                      for k, v in res.items() if isinstance(v, dict)]
        else:
            lines.append(f"{mode}: " + ", ".join(f"{x:.0f}" for x in res["request_ms"]) + " ms")
    return common.write_result(out, "\n".join(lines), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
