"""Host memory the engine's weights take on CPU: the bytes of the decode and prefill phases' parameter arrays, by
kind (routed experts / other, f32 twins of bf16 weights / the weights themselves), and the resident set size of a
`jaxserve serve` process once /ready answers 200. Both with serve's defaults (`make serve`).

Usage: python bench/resident_weights.py [--tree DIR ...] [--reps N] [--warmup fast|none] [--checkpoint DIR]
                                         --json OUT.json

Each --tree is a source tree (default: this checkout) whose `jaxserve` runs the measurement in its own processes
(cwd and PYTHONPATH the tree), so two trees compare code before and after a change on the same checkpoint.
Once per tree: parameter bytes (`Engine.from_checkpoint`, each array of both phases' state counted once: a phase
may share the other's) and the greedy tokens of three prompts, alone and together. Per repetition, the trees
alternating: VmRSS and VmHWM of a `jaxserve serve` process from /proc once /ready answers 200 (--warmup: none
measures the loaded weights and runtime, fast adds its compiled programs; --no-compile-cache). The host's load
average is recorded with each run (the host may be shared).
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
if os.environ.get("RESIDENT_WEIGHTS_CHILD") != "1":  # a child imports the jaxserve of its tree (PYTHONPATH)
    sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.serving import is_ready, listening_port, stop_server  # noqa: E402

KINDS = ("experts", "experts_twins", "other", "other_twins")
PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):"]
GREEDY_TOKENS = 32


def kind(path: str) -> str:
    """The byte bucket of the parameter at dotted `path` (an f32 twin's field name holds "wide")."""
    twin = "wide" in path.rsplit(".", 1)[-1]
    return ("experts" if ".experts." in f".{path}." else "other") + ("_twins" if twin else "")


def param_bytes(checkpoint: Path) -> dict:
    """In this process (run by `--child`): bytes of the serve-default engine's phase parameters, by kind, and the
    greedy tokens of PROMPTS (GREEDY_TOKENS each; alone: one-row decode steps, then together)."""
    import jax
    from flax import nnx

    import jaxserve
    from jaxserve.cli import build_parser
    from jaxserve.engine import Engine, SamplingParams
    from jaxserve.server.main import engine_config, start_jax

    args = build_parser().parse_args(["serve", "--checkpoint", str(checkpoint)])
    engine = Engine.from_checkpoint(checkpoint, engine_config(args, start_jax(args)), start=True)
    seen: set[int] = set()
    out = dict.fromkeys(KINDS, 0)
    try:
        for phase in (engine.programs.prefill_phase, engine.programs.decode_phase):
            for path, var in nnx.to_flat_state(phase.state):
                a = var.get_value()
                if isinstance(a, jax.Array) and id(a) not in seen:
                    seen.add(id(a))
                    out[kind(".".join(map(str, path)))] += int(a.nbytes)
        sp = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
        tokens = [engine.generate([p], sp)[0].token_ids for p in PROMPTS]
        tokens += [o.token_ids for o in engine.generate(PROMPTS, sp)]
    finally:
        engine.close()
    return {"bytes": out, "total": sum(out.values()), "greedy_tokens": tokens,
            "jaxserve": str(Path(jaxserve.__file__).parent)}


def child(tree: Path, checkpoint: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "RESIDENT_WEIGHTS_CHILD": "1"}
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--checkpoint", str(checkpoint)],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{tree}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _status(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            fields[k] = int(v.split()[0]) * 1024
    return fields


def serve_rss(tree: Path, checkpoint: Path, warmup: str, log: Path) -> dict:
    """Start `jaxserve serve` from `tree`, wait for /ready, -> VmRSS / VmHWM bytes and seconds to ready."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--checkpoint",
           str(checkpoint), "--no-compile-cache", "--warmup", warmup]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t0 = time.perf_counter()
    with log.open("w") as errf:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=errf, text=True)
    port = None
    try:
        while time.perf_counter() - t0 < 600:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            if port is None:
                port = listening_port(log)
            elif is_ready(port):
                return {**_status(proc.pid), "ready_s": time.perf_counter() - t0, "loadavg": os.getloadavg()[0]}
            time.sleep(0.2)
        raise RuntimeError("server not ready within 600 s")
    finally:
        stop_server(proc)


def run(trees: list[Path], reps: int, warmup: str, checkpoint: Path) -> dict:
    params = {str(t): {**child(t, checkpoint), "loadavg": os.getloadavg()[0]} for t in trees}
    runs: dict[str, list[dict]] = {str(t): [] for t in trees}
    with tempfile.TemporaryDirectory() as td:
        for _ in range(reps):
            for t in trees:
                runs[str(t)].append(serve_rss(t, checkpoint, warmup, Path(td) / "log"))
    first = params[str(trees[0])]["greedy_tokens"]
    summary = {t: {"param_bytes": params[t]["bytes"], "param_total": params[t]["total"],
                   "greedy_tokens_equal_first_tree": params[t]["greedy_tokens"] == first,
                   "rss": common.spread([r["VmRSS"] for r in v]), "hwm": common.spread([r["VmHWM"] for r in v]),
                   "ready_s": common.spread([r["ready_s"] for r in v])} for t, v in runs.items()}
    return {"bench": "resident_weights", "machine": common.machine(), "reps": reps, "warmup": warmup,
            "checkpoint": str(checkpoint),
            "command": f"python -m jaxserve.cli serve --checkpoint CKPT --no-compile-cache --warmup {warmup}",
            "params": params, "runs": runs, "summary": summary,
            "notes": "params: both phases' state arrays, each counted once; RSS: /proc VmRSS after /ready; trees "
                     "alternate in each repetition; shared host, load average per run"}


def table(r: dict) -> str:
    mb = lambda b: f"{b / 1e6:.1f}"  # noqa: E731
    spread = lambda d: f"{mb(d['median'])} ({mb(d['min'])}..{mb(d['max'])})"  # noqa: E731
    lines = [f"  {'tree':<24} {'params MB':>9} {'experts/twins':>14} {'other/twins':>12} {'RSS MB':>22} "
             f"{'HWM MB':>22} tokens"]
    for t, s in r["summary"].items():
        b = s["param_bytes"]
        lines.append(f"  {t[-24:]:<24} {mb(s['param_total']):>9} {mb(b['experts']) + '/' + mb(b['experts_twins']):>14} "
                     f"{mb(b['other']) + '/' + mb(b['other_twins']):>12} {spread(s['rss']):>22} {spread(s['hwm']):>22} "
                     f"{'same' if s['greedy_tokens_equal_first_tree'] else 'DIFFER'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, action="append", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", choices=["none", "fast"], default="none")
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "tiny-kimi")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the in-process byte count
    ap.add_argument("--json", dest="json_out", type=Path, default=None)
    args = ap.parse_args(argv)
    checkpoint = args.checkpoint.resolve()
    if args.child:
        print(json.dumps(param_bytes(checkpoint)))
        return 0
    if args.json_out is None:
        ap.error("--json is required")
    r = run([t.resolve() for t in args.tree or [ROOT]], args.reps, args.warmup, checkpoint)
    return common.write_result(r, table(r), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
