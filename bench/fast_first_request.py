"""What the first requests after a `--warmup fast` ready pay for the background compiles starting beside them: the
embedded model under `serve --max-model-len 256`'s engine config (the user's compile cache), `warm_up("fast")`, then
`--requests` lone requests one after another (an 87-token prompt, the first-contact bench's chat prompt length, 32
sampled tokens), each timed end to end, with the background thread running as serve runs it ("running": nice 19 and
the 0.5 ms GIL switch interval), running with only the nice value ("running_nice_only": `short_switch_interval`
skipped), running as before either ("running_before": `lower_priority` skipped too) or held ("held"), each in its
own process; the XLA compiles and compile-cache loads on the engine thread are counted.

Usage: python bench/fast_first_request.py [--requests 4] --json OUT.json
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
import contextlib, json, sys, threading, time, jax
from jaxserve.cli import build_parser, default_checkpoint
from jaxserve.engine import Engine, SamplingParams
from jaxserve.engine.compile_cache import enable_from_args
from jaxserve.engine import fallback
from jaxserve.server.main import engine_config
if sys.argv[1] in ("running_nice_only", "running_before"):
    fallback.short_switch_interval = contextlib.nullcontext
if sys.argv[1] == "running_before":
    fallback.lower_priority = lambda: False
args = build_parser().parse_args(["serve", "--max-model-len", "256"])
enable_from_args(args)
engine = Engine.from_checkpoint(default_checkpoint(), engine_config(args))
line = engine.warm_up("fast", hold=threading.Event() if sys.argv[1] == "held" else None).line()
loads = []
jax.monitoring.register_event_listener(lambda event, **_: loads.append(threading.current_thread().name)
                                       if event == "/jax/compilation_cache/cache_hits" else None)
jax.monitoring.register_event_duration_secs_listener(
    lambda event, s, **_: loads.append(threading.current_thread().name)
    if event == "/jax/core/compile/backend_compile_duration" else None)
seconds = []
for i in range(int(sys.argv[2])):
    t0 = time.monotonic()
    engine.generate([[(31 * j + i) % 4000 + 10 for j in range(87)]],
                    SamplingParams(max_tokens=32, ignore_eos=True, temperature=1.0))
    seconds.append(time.monotonic() - t0)
engine.close()
print(json.dumps({"warmup": line, "seconds": seconds, "engine_thread_loads": loads.count("jaxserve-engine")}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    out: dict = {"bench": "fast_first_request", "command": "python bench/fast_first_request.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": common.machine()}
    names = ("running", "running_nice_only", "running_before", "held")
    for name in names:
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, "-c", _RUN, name, str(args.requests)], cwd=ROOT, check=True,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        out[name] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "load_before": load,
                     "load_after": os.getloadavg()[0]}
    text = "; ".join(f"background {n}: " + ", ".join(f"{s:.2f}" for s in out[n]["seconds"]) + " s" for n in names)
    return common.write_result(out, text, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
