"""XLA:CPU flags against the embedded model's steady decode and verify programs (issue #33): each flag set in its own
child process (XLA reads its flags once, when the backend starts), the children run one after another in alternating
order (A B C, C B A, ...) so a drift in the shared host's load hits every set alike.

Usage: python bench/xla_cpu_flags.py [--sets base,noeigen,...] [--rounds 2] [--reps 150]
                                     [--json bench/results/xla_cpu_flags.json]

Every set starts from `serve`'s CPU layout flags (`cpu_layout.SCHED_FLAG`) and adds its own (SETS). Per child, like
bench/step_cuts.py "now": an engine (serving EngineConfig, no prefix cache) steps R prompts to a steady step, its
decode (plain) or verify (ngram:3) program is captured (`step_cuts.build`) and called --reps times back to back (5
untimed first).
Reported per (set, method, rows): program ms median (min..max, p10) over the rounds' calls, and whether the first
call's greedy tokens equal the base set's (a flag that changes numerics changes them). Load is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETS = {
    "base": "",
    "noeigen": "--xla_cpu_multi_thread_eigen=false",  # each op on the calling thread: no hand-offs to the pool
    "noynn": "--xla_cpu_experimental_ynn_fusion_type=",  # dots through XLA's own emitters, not YNNPACK
    "fastmath": "--xla_cpu_enable_fast_math=true",
    "split1": "--xla_cpu_parallel_codegen_split_count=1",
    "nosched": "",  # serve's flag left out (the "single" layout)
}


def child(method: str, rows: list[int], reps: int) -> dict:
    """Runs inside a child: times each rows' program and returns {rows: {"ms": [...], "tokens": [...]}}."""
    import jax

    from bench.spec_profile import call
    from bench.step_cuts import build

    out = {}
    for r in rows:
        b = build("now", method, r)  # the engine, its captured steady program and first tokens, as step_cuts has them
        for i in range(reps + 5):
            t0 = time.perf_counter()
            jax.block_until_ready(call(b["engine"], b["fn"], b["rest"]))
            if i >= 5:
                b["ms"].append((time.perf_counter() - t0) * 1e3)
        b["engine"].close()
        out[str(r)] = {"ms": b["ms"], "tokens": b["tokens"].tolist()}
    return out


def run_child(flags: str, method: str, rows: list[int], reps: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from bench import xla_cpu_flags as b; "
            f"print('RESULT' + json.dumps(b.child({method!r}, {rows!r}, {reps})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if proc.returncode != 0 or not line:
        return {"error": (proc.stderr or proc.stdout)[-800:]}
    return json.loads(line[-1].removeprefix("RESULT"))


def main() -> int:
    from bench import common
    from jaxserve.server.cpu_layout import SCHED_FLAG

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--methods", default="plain,ngram")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sets = args.sets.split(",")
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise SystemExit(f"unknown flag sets {unknown}: {', '.join(SETS)}")
    rows = [int(r) for r in args.rows.split(",")]
    flags = {s: SETS[s] if s == "nosched" else f"{SCHED_FLAG} {SETS[s]}".strip() for s in sets}
    got: dict = {}
    load0 = os.getloadavg()
    for rnd in range(args.rounds):
        order = sets if rnd % 2 == 0 else sets[::-1]
        for method in args.methods.split(","):
            for s in order:
                res = run_child(flags[s], method, rows, args.reps)
                print(f"round {rnd + 1} {method} {s}: "
                      + (res["error"].splitlines()[-1] if "error" in res else
                         ", ".join(f"rows {r} {np.median(v['ms']):.2f} ms" for r, v in res.items())), flush=True)
                slot = got.setdefault(s, {}).setdefault(method, {})
                if "error" in res:
                    slot["error"] = res["error"]
                    continue
                for r, v in res.items():
                    e = slot.setdefault(r, {"ms": [], "tokens": v["tokens"]})
                    e["ms"] += v["ms"]
    load1 = os.getloadavg()
    rows_out = []
    for s in sets:
        for method, by_rows in got.get(s, {}).items():
            if "error" in by_rows:
                rows_out.append({"set": s, "flags": flags[s], "method": method, "error": by_rows["error"]})
                continue
            for r, e in by_rows.items():
                base = got.get(sets[0], {}).get(method, {}).get(r, {}).get("tokens")
                rows_out.append({"set": s, "flags": flags[s], "method": method, "rows": int(r),
                                 "ms": {**common.spread(e["ms"]), "p10": float(np.percentile(e["ms"], 10))},
                                 "tokens_equal_first_set": e["tokens"] == base})
    lines = [f"XLA:CPU flag sets, load {load0[0]:.1f} -> {load1[0]:.1f}, {args.rounds} rounds x {args.reps} calls"]
    for row in rows_out:
        if "error" in row:
            lines.append(f"{row['set']:<9} {row['method']:<6} error")
            continue
        ms = row["ms"]
        lines.append(f"{row['set']:<9} {row['method']:<6} rows {row['rows']:>2} {ms['median']:.2f} ms "
                     f"({ms['min']:.2f}..{ms['max']:.2f}, p10 {ms['p10']:.2f}), tokens equal {row['tokens_equal_first_set']}")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows_out, "loadavg_start": load0, "loadavg_end": load1,
                                               "rounds": args.rounds, "reps": args.reps}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
