"""Is there a first-use cost in the feature paths (issue 32)? After `warm_up("fast")` and serve's start-up work (the
embedded model, `serve --max-model-len 256`'s engine config, the user's compile cache; the background compiles held),
in a fresh process per kind: `--requests` streamed chat completions of that kind one after another through the
server app (Flask test client, no socket; ~64 tokens of user text, 1 token: about a TTFT), end to end, in ms.

Kinds: "plain"; "json_schema" (a response_format); "tools_auto" / "tools_required" (one tool, tool_choice auto /
required: required compiles a Lark tool-call grammar); "top_logprobs" (logprobs, top_logprobs 5); "features" (the
first-contact bench's feature sweep body: tools auto + json_schema + top_logprobs 5). Each request's host work is
split out: "parse" (`parse_chat`: body, chat template with the tools, tool setup), "matcher" (`GrammarCompiler.
matcher`: llguidance's tokenizer on first use, the grammar's serialization and compile, on the request's thread),
"bitmask" (the masks the engine loop computed for it); "rest" = total - those (engine steps, SSE, detokenization).

--startup plain: serve's start-up as before this probe (`first_request`: one short greedy request); all: also
`first_feature_request` (the feature paths once). Usage: python bench/first_grammar.py [--requests 5]
[--kinds plain,json_schema,...] [--startup plain,all] --json OUT.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402

KINDS = ("plain", "json_schema", "tools_auto", "tools_required", "top_logprobs", "features")

_RUN = """
import json, sys, threading, time
from jaxserve.cli import build_parser, default_checkpoint
from jaxserve.engine import Engine
from jaxserve.engine.compile_cache import enable_from_args
from jaxserve.server import app as app_module
from jaxserve.server import main as server_main
from bench.serving_first_contact import SCHEMA, TOOLS
kind, startup, requests = sys.argv[1], sys.argv[2], int(sys.argv[3])
args = build_parser().parse_args(["serve", "--max-model-len", "256"])
enable_from_args(args)
engine = Engine.from_checkpoint(default_checkpoint(), server_main.engine_config(args, server_main.start_jax(args)))
out = {"warmup": engine.warm_up("fast", hold=threading.Event()).line()}
t0 = time.perf_counter()
server_main.first_request(engine)
if startup == "all":
    server_main.first_feature_request(engine)
out["startup_ms"] = (time.perf_counter() - t0) * 1e3
spent = {"parse": 0.0, "matcher": 0.0, "bitmask": 0.0}
def timing(name, fn):
    def wrapped(*a):
        t = time.perf_counter()
        try:
            return fn(*a)
        finally:
            spent[name] += (time.perf_counter() - t) * 1e3
    return wrapped
app_module.parse_chat = timing("parse", app_module.parse_chat)
engine.grammar.matcher = timing("matcher", engine.grammar.matcher)
engine.grammar.bitmask = timing("bitmask", engine.grammar.bitmask)
client = app_module.create_app(engine, "tiny").test_client()
text = " ".join(f"w{j}" for j in range(48))
extra = {"plain": {}, "json_schema": {"response_format": SCHEMA}, "tools_auto": {"tools": TOOLS},
         "tools_required": {"tools": TOOLS, "tool_choice": "required"},
         "top_logprobs": {"logprobs": True, "top_logprobs": 5},
         "features": {"tools": TOOLS, "tool_choice": "auto", "response_format": SCHEMA, "logprobs": True,
                      "top_logprobs": 5}}[kind]
rows = []
for i in range(requests):
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"{i} {text}"}], "max_tokens": 1,
            "stream": True, **extra}
    for k in spent:
        spent[k] = 0.0
    t = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.get_data(as_text=True).rstrip().endswith("[DONE]"), r.get_data(as_text=True)
    total = (time.perf_counter() - t) * 1e3
    rows.append({"total": total, **spent, "rest": total - sum(spent.values())})
out["requests"] = rows
engine.close()
print(json.dumps(out))
"""


def summary(rows: list[dict]) -> dict:
    """first, second and median of the rest (ms) of each split."""
    return {k: {"first": rows[0][k], "second": rows[1][k], "median_rest": statistics.median(r[k] for r in rows[2:])}
            for k in rows[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--startup", default="plain,all")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    out: dict = {"bench": "first_grammar", "command": "python bench/first_grammar.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": common.machine()}
    lines = [f"{'startup/kind':<22} {'total first/second/median':>27}  first: parse matcher bitmask rest  (ms)"]
    for startup in args.startup.split(","):
        for kind in args.kinds.split(","):
            load = os.getloadavg()[0]
            proc = subprocess.run([sys.executable, "-c", _RUN, kind, startup, str(args.requests)], cwd=ROOT,
                                  check=True, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})  # its stderr: the log
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            res = out[f"{startup}/{kind}"] = {**res, "summary": summary(res["requests"]), "load_before": load,
                                               "load_after": os.getloadavg()[0]}
            s, f = res["summary"]["total"], res["requests"][0]
            lines.append(f"{startup + '/' + kind:<22} {s['first']:8.1f} {s['second']:8.1f} {s['median_rest']:8.1f}"
                         f"   {f['parse']:6.1f} {f['matcher']:6.1f} {f['bitmask']:6.1f} {f['rest']:6.1f}"
                         f"  (start-up {res['startup_ms']:.0f} ms, load {load:.1f})")
    return common.write_result(out, "\n".join(lines), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
