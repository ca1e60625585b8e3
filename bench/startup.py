"""Start-up: `jaxserve serve` (what `make serve` runs, default flags) to the first completed 16-token request,
with a cold and a warm persistent compilation cache.

Usage: python bench/startup.py [--reps N] [--checkpoint DIR] --json OUT.json

Each run starts a fresh server process on a free port with `--compile-cache DIR`: "cold" runs get a new empty
folder (what a fresh machine has: every program compiles), "warm" runs reuse the folder a cold run filled (a
restart: programs load from disk). Timed from process spawn (Python and JAX imports, checkpoint load included) to
(a) the server listening and (b) the first POST /v1/completions with max_tokens 16 (greedy, eos ignored)
returning complete. Also a run with --no-compile-cache, which equals cold on every start. Runs interleave cold
and warm; the host's load average is recorded with each (the host may be shared).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.serving import listening_port, stop_server  # noqa: E402

NEW_TOKENS = 16
PROMPT = "The quick brown fox"


def start(checkpoint: Path | None, cache: Path | None, log: Path) -> tuple[subprocess.Popen, int, float, float]:
    """Spawn `jaxserve serve` -> (process, port, spawn time, seconds until it printed its address)."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--checkpoint", str(checkpoint)] if checkpoint else []
    cmd += ["--compile-cache", str(cache)] if cache else ["--no-compile-cache"]
    errf = log.open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=errf, text=True)
    while time.perf_counter() - t0 < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if (port := listening_port(log)) is not None:
            return proc, port, t0, time.perf_counter() - t0
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError("server did not start within 300 s")


def complete(port: int) -> int:
    """One 16-token completion; -> completion tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = json.loads(r.read())
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"completion failed: {r.status} {out}")
    return int(out["usage"]["completion_tokens"])


def one_run(checkpoint: Path | None, cache: Path | None, log: Path) -> dict:
    proc, port, t0, listen = start(checkpoint, cache, log)
    try:
        tokens = complete(port)
        first = time.perf_counter() - t0
    finally:
        stop_server(proc)
    return {"listening_s": listen, "first_request_s": first, "completion_tokens": tokens,
            "loadavg": os.getloadavg()[0]}


def run(reps: int, checkpoint: Path | None) -> dict:
    runs: dict[str, list[dict]] = {"cold": [], "warm": [], "no_cache": []}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for i in range(reps):
            cache = tmp / f"cache{i}"  # a fresh, empty folder: a cold start
            runs["cold"].append(one_run(checkpoint, cache, tmp / "log"))
            runs["warm"].append(one_run(checkpoint, cache, tmp / "log"))
            runs["no_cache"].append(one_run(checkpoint, None, tmp / "log"))
            runs["cold"][-1]["cache_files"] = sum(1 for _ in cache.rglob("*") if _.is_file())
    summary = {k: {m: common.spread([r[m] for r in v]) for m in ("listening_s", "first_request_s")}
               for k, v in runs.items()}
    return {"bench": "startup", "machine": common.machine(), "reps": reps, "new_tokens": NEW_TOKENS,
            "command": "python -m jaxserve.cli serve (make serve's defaults) --compile-cache DIR | --no-compile-cache",
            "runs": runs, "summary": summary,
            "goals_s": {"cold": 15.0, "warm": 5.0},
            "notes": "spawn to first completed 16-token /v1/completions (greedy, ignore_eos); cold: empty cache "
                     "folder; warm: the folder the previous cold run filled; shared host, load average per run"}


def table(r: dict) -> str:
    lines = [f"  {'start':>9} {'listening s':>22} {'first 16-token request s':>26}"]
    for k, s in r["summary"].items():
        f = lambda d: f"{d['median']:.2f} ({d['min']:.2f}..{d['max']:.2f})"  # noqa: E731
        lines.append(f"  {k:>9} {f(s['listening_s']):>22} {f(s['first_request_s']):>26}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    r = run(args.reps, args.checkpoint)
    return common.write_result(r, table(r), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
