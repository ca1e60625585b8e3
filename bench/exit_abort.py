"""An engine never closed, exiting while its fast warm-up's background thread compiles (issue #32): how often the
process aborts at exit, with the engine's exit hook (`engine.exit_hook`) and with it cancelled, interleaved.

Usage: python bench/exit_abort.py [--reps 4] [--sleep 2] [--json bench/results/exit_abort.json]

Each run is a fresh child process on an empty compile cache (so the background thread is compiling, not loading):
the embedded model, `--max-model-len 256`, `warm_up("fast")`, `--sleep` seconds, then the end of the script with
no `Engine.close()`. Arms: "hook" (the tree) and "no-hook" (the hook cancelled in the child: before the fix).
Reported per arm: exit codes (134 is the abort: "FATAL: exception not rethrown") and seconds per run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import sys, time
sys.path.insert(0, {root!r})
import jax
jax.config.update("jax_compilation_cache_dir", {cache!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from bench.speculative import CKPT
from jaxserve.engine import Engine, EngineConfig
e = Engine.from_checkpoint(CKPT, EngineConfig(max_model_len=256), start=True)
if {cancel}:
    e._cancel_exit_close()
e.warm_up("fast")
time.sleep({sleep})
print("background alive at the end:", e.scheduler.shapes.thread.is_alive(), flush=True)
"""


def run(arm: str, sleep: float) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        code = CHILD.format(root=str(ROOT), cache=cache, cancel=arm == "no-hook", sleep=sleep)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        secs = time.perf_counter() - t0
    alive = "background alive at the end: True" in proc.stdout
    fatal = "exception not rethrown" in proc.stderr
    return {"arm": arm, "rc": proc.returncode, "seconds": round(secs, 1), "background_alive": alive, "fatal": fatal}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--sleep", type=float, default=2.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    load0 = os.getloadavg()
    runs = []
    for i in range(args.reps):
        for arm in (("hook", "no-hook") if i % 2 == 0 else ("no-hook", "hook")):
            r = run(arm, args.sleep)
            runs.append(r)
            print(f"rep {i + 1} {arm:<8} rc {r['rc']} ({r['seconds']} s, background alive {r['background_alive']})",
                  flush=True)
    load1 = os.getloadavg()
    lines = [f"exit without close, load {load0[0]:.1f} -> {load1[0]:.1f}"]
    for arm in ("hook", "no-hook"):
        rcs = [r["rc"] for r in runs if r["arm"] == arm]
        lines.append(f"{arm:<8} {sum(rc != 0 for rc in rcs)} of {len(rcs)} aborted, exit codes {rcs}")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "sleep": args.sleep, "loadavg_start": load0,
                                               "loadavg_end": load1}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
