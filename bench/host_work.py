"""Per-request host work vs. other streams: the largest gap between tokens of one running stream while another
client sends (a) a 3.8 MB chat body, (b) a json_schema response_format of ~10k tokens, (c) a request with 100 tools
(tool_choice "required"), against the same stream alone; the kinds interleaved, --reps times each.

Usage: python bench/host_work.py [--reps N] [--tokens N] [--checkpoint DIR] [--json OUT.json]

It starts `jaxserve serve` on the embedded model (bench/serving.py's child process), warms every kind up once
(untimed: the first masked-sampling program compiles there), then per rep and kind streams one greedy completion
(/v1/completions, stream, logprobs 0: one SSE chunk per token) and, once 20 tokens have arrived, sends the heavy
request 3 times back to back with max_tokens 1 (its own decode would share the stream's batch: engine work, not
host work). Gap: between consecutive token chunks after the 5th; "window": the gaps of chunks that arrived while
the heavy requests were in flight. Reported: median and min..max over reps of each run's largest gap.

It also measures in-process how long each piece of host work holds the GIL (a thread that wakes every 1 ms logs its
largest gap while the work runs on another): llguidance's compile of the ~10k-token schema and of the 100-tool
grammar, json.loads of the 3.8 MB body, and the chat template render + bounded encode of it.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402
from bench.serving import bench_checkpoint, get_json, start_server, stop_server  # noqa: E402

SENDS = 3  # heavy requests per run, back to back
START_AFTER = 20  # stream tokens before the heavy requests start
SKIP = 5  # first gaps left out (the stream's own start)
BODY_BYTES = 3_800_000


# ---------------------------------------------------------------------------------------------------- requests
def big_schema(fields: int = 150) -> dict:
    """A JSON schema of `fields` properties (enums, nested objects, arrays): ~10k tokens of the tiny tokenizer."""
    props = {}
    for i in range(fields):
        if i % 3 == 0:
            props[f"field_{i}"] = {"type": "string", "enum": [f"value_{i}_{j}" for j in range(6)]}
        elif i % 3 == 1:
            props[f"field_{i}"] = {"type": "object", "properties": {"count": {"type": "integer"}, "label": {
                "type": "string"}, "flag": {"type": "boolean"}}, "required": ["count", "label"]}
        else:
            props[f"field_{i}"] = {"type": "array", "items": {"type": "number"},
                                   "description": f"the measurements of sensor {i}"}
    return {"type": "object", "properties": props, "required": list(props)}


def tools(n: int = 100) -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"does thing {i}", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                                             "days": {"type": "integer"}}, "required": ["city"]}}} for i in range(n)]


def big_messages(total: int = BODY_BYTES, parts: int = 200) -> list[dict]:
    piece = ("The quick brown fox jumps over the lazy dog. " * (total // parts // 45 + 1))[: total // parts]
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": piece} for i in range(parts)]


def heavy_bodies(model: str) -> dict[str, bytes]:
    """kind -> the serialized request body (serialized once, before any timing)."""
    base = {"model": model, "max_tokens": 1, "temperature": 0}
    hi = [{"role": "user", "content": "Give me the record."}]
    return {
        "body_3.8MB": json.dumps({**base, "messages": big_messages()}).encode(),
        "json_schema_10k": json.dumps({**base, "messages": hi, "response_format": {
            "type": "json_schema", "json_schema": {"name": "record", "schema": big_schema()}}}).encode(),
        "tools_100": json.dumps({**base, "messages": hi, "tools": tools(), "tool_choice": "required"}).encode(),
    }


# ---------------------------------------------------------------------------------------------------- one run
def post(port: int, path: str, body: bytes) -> dict:
    """-> {"status", "seconds", and for an error its message}."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    answer = r.read()
    conn.close()
    out = {"status": r.status, "seconds": round(time.perf_counter() - t0, 3)}
    if r.status != 200:
        out["error"] = json.loads(answer).get("error", {}).get("message", "")[:160]
    return out


def stream_times(port: int, model: str, max_tokens: int, on_token: Callable[[int], None]) -> list[float]:
    """Stream one greedy completion -> the arrival time of each token chunk; on_token(count) after each."""
    body = json.dumps({"model": model, "prompt": "def add(a, b):", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "logprobs": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    times: list[float] = []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        if json.loads(line[6:]).get("choices"):
            times.append(time.perf_counter())
            on_token(len(times))
    conn.close()
    return times


def run(port: int, model: str, max_tokens: int, heavy: bytes | None) -> dict:
    """One stream, with `heavy` sent SENDS times once it is START_AFTER tokens in -> its gaps and the sends."""
    go = threading.Event()
    sends: list[dict] = []
    window: list[float] = []

    def interfere() -> None:
        go.wait()
        window.append(time.perf_counter())
        for _ in range(SENDS):
            sends.append(post(port, "/v1/chat/completions", heavy))
        window.append(time.perf_counter())

    thread = threading.Thread(target=interfere, daemon=True) if heavy is not None else None
    if thread is not None:
        thread.start()
    times = stream_times(port, model, max_tokens, lambda n: n == START_AFTER and go.set())
    if thread is not None:
        thread.join()
    gaps = [(b - a, b) for a, b in zip(times[SKIP:], times[SKIP + 1:])]
    out = {"tokens": len(times), "max_gap_ms": 1e3 * max(g for g, _ in gaps),
           "p50_gap_ms": 1e3 * statistics.median(g for g, _ in gaps)}
    if heavy is not None:
        inside = [g for g, t in gaps if window[0] <= t <= window[1] + 0.5]  # + the chunk the last send held back
        out.update(window_max_gap_ms=1e3 * max(inside, default=0.0), covered=window[1] < times[-1],
                   sends=sends)
    return out


# ---------------------------------------------------------------------------------------------------- GIL holds
def gil_hold(fn: Callable[[], object], reps: int = 3) -> dict:
    """Run fn `reps` times beside a thread that sleeps 1 ms per turn -> fn's seconds and that thread's largest gap
    (ms; a gap near fn's duration means fn held the GIL throughout)."""
    runs = []
    for _ in range(reps):
        gaps: list[float] = []
        stop = threading.Event()

        def tick() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                time.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        t = threading.Thread(target=tick)
        t.start()
        time.sleep(0.05)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        time.sleep(0.02)
        stop.set()
        t.join()
        runs.append((dt, max(gaps)))
    return {"work_ms": [round(1e3 * d, 1) for d, _ in runs], "max_tick_gap_ms": [round(1e3 * g, 1) for _, g in runs]}


def gil_holds(checkpoint: Path) -> dict:
    import llguidance

    from jaxserve.engine.structured import GrammarCompiler, json_schema_output
    from jaxserve.server.toolcalls import ToolSetup
    from jaxserve.tokenizer import Tokenizer

    tok = Tokenizer(checkpoint)
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    ll = compiler._lltokenizer()
    schema = json_schema_output(big_schema()).grammar()
    tool_grammar = ToolSetup("kimi", tuple(tools()), "required").grammar().grammar()
    body = heavy_bodies("m")["body_3.8MB"]
    messages = json.loads(body)["messages"]
    return {
        "idle": gil_hold(lambda: time.sleep(0.05)),
        "schema_tokens": len(tok.encode(json.dumps(big_schema()))),
        "compile_json_schema_10k": gil_hold(lambda: llguidance.LLMatcher(ll, schema, log_level=0)),
        "compile_tools_100": gil_hold(lambda: llguidance.LLMatcher(ll, tool_grammar, log_level=0)),
        "json_loads_3.8MB": gil_hold(lambda: json.loads(body)),
        "template_and_encode_3.8MB": gil_hold(lambda: tok.encode_chat(messages, limit=512)),
    }


# ---------------------------------------------------------------------------------------------------- main
def summary(runs: list[dict], key: str) -> str:
    vals = [r[key] for r in runs if key in r]
    return f"{statistics.median(vals):7.1f} ({min(vals):.1f}..{max(vals):.1f})" if vals else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=400, help="the running stream's max_tokens")
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "host_work.json")
    args = ap.parse_args()
    result = {"machine": common.machine(), "reps": args.reps, "tokens": args.tokens, "sends": SENDS}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, name = bench_checkpoint(args.checkpoint, Path(tmp))
        result["model"] = name
        result["gil"] = gil_holds(ckpt)
        proc, port = start_server(ckpt, 8, Path(tmp) / "server.log")
        try:
            model = get_json("127.0.0.1", port, "/v1/models")["data"][0]["id"]
            bodies = heavy_bodies(model)
            # warm-up: the compiles a first use triggers (the stream's page buckets, the masked sampling programs)
            # are not host work
            for heavy in [None, *bodies.values()]:
                print("warm-up:", run(port, model, args.tokens, heavy), flush=True)
            kinds: dict[str, list[dict]] = {"alone": [], **{k: [] for k in bodies}}
            for rep in range(args.reps):
                for kind in kinds:  # interleaved: a drift in the host's load hits every kind alike
                    kinds[kind].append(run(port, model, args.tokens, bodies.get(kind)))
                    print(f"rep {rep} {kind}: {kinds[kind][-1]}", flush=True)
        finally:
            stop_server(proc)
    result["runs"] = kinds
    result["loadavg_at_end"] = os.getloadavg()
    lines = [f"model: {result['model']}; load average at start {result['machine']['loadavg_at_start']}, at end "
             f"{result['loadavg_at_end']}", f"{'while another client sends':28} {'max gap ms':>22} "
             f"{'max gap in window ms':>24} {'p50 gap ms':>22}"]
    for kind, runs in kinds.items():
        lines.append(f"{kind:28} {summary(runs, 'max_gap_ms'):>22} {summary(runs, 'window_max_gap_ms'):>24} "
                     f"{summary(runs, 'p50_gap_ms'):>22}")
    lines.append("GIL: work ms / largest gap of a 1 ms ticker thread ms (3 runs each)")
    for k, v in result["gil"].items():
        lines.append(f"  {k}: {v}")
    return common.write_result(result, "\n".join(lines), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
