"""One `jaxserve plan ... --json` run, timed: its wall time and the host's load (the 1-minute load average sampled
every 15 s while it runs) written beside the plan as its "run" record, with the command.

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD .venv-aot/bin/python bench/plan_timed.py bench/results/plan_v6e_glm_52.json \
        --preset glm-5.2 --devices 32 --target v6e

The plan runs niced (`nice -n 10`: the host is shared) with ALLOW_MULTIPLE_LIBTPU_LOAD=1 and JAX_PLATFORMS=cpu.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def timed(out: Path, args: list[str]) -> int:
    cmd = ["nice", "-n", "10", sys.executable, "-m", "jaxserve.cli", "plan", *args, "--json", "--no-progress"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    samples, done = [_load()], threading.Event()

    def sample() -> None:
        while not done.wait(15):
            samples.append(_load())

    threading.Thread(target=sample, daemon=True).start()
    tree = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
    t0, started = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    done.set()
    if proc.returncode:
        print(proc.stderr[-4000:], file=sys.stderr)
        print(f"plan failed (rc {proc.returncode}) after {wall:.0f} s", file=sys.stderr)
        return proc.returncode
    plan = json.loads(proc.stdout)
    plan["run"] = {"command": "JAX_PLATFORMS=cpu ALLOW_MULTIPLE_LIBTPU_LOAD=1 nice -n 10 python -m jaxserve.cli plan "
                              + " ".join(args) + " --json --no-progress",
                   "tree": tree, "started_utc": started, "wall_s": round(wall, 1),
                   "load_1m_mean": round(sum(samples) / len(samples), 1), "load_1m_max": max(samples),
                   "load_samples": len(samples), "cpus": os.cpu_count()}
    out.write_text(json.dumps(plan, indent=1) + "\n")
    print(f"{out}: {wall:.0f} s at load {plan['run']['load_1m_mean']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit("usage: plan_timed.py OUT.json <jaxserve plan arguments>")
    raise SystemExit(timed(Path(sys.argv[1]), sys.argv[2:]))
