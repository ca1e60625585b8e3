"""First contact, as a standard serving benchmark meets a fresh server (bench/serving.py `--first-contact`; issue 32):
what a new user measures with aiperf before anyone warmed anything by hand.

For each `--warmup` level: start a fresh `jaxserve serve` on the embedded model (the persistent compile cache as the
user has it: warm allowed) and time spawn -> listening -> `/ready` 200; then streaming chat sweeps at concurrency
1, 4 and 16 (each client sends its next request when its last one finished; `max(min_requests, rounds x c)`
requests per concurrency) of `prompt_tokens`-token prompts (held-out stdlib text, a different window per request)
and `output_tokens`-token answers (ignore_eos, usage from the server): first the plain sweep twice ("first" = first
contact, "warm" = the same workload shape again, new draws), then the feature sweep (tools with tool_choice auto +
a json_schema response_format + logprobs with top_logprobs 5; no ignore_eos: the grammar may end the answer) twice.
A token arrival is an SSE chunk carrying content, reasoning_content or tool_calls. Per sweep and concurrency: TTFT
(send -> first token chunk) and ITL (gaps between token chunks) p50/p99, the largest gap inside one stream, and
the first/warm TTFT p99 ratio. Goals (issue 32): that ratio <= 1.5 at every concurrency, no gap > 1 s in any sweep
(on a quiet host: the load average before and after each level is recorded). `--trace [DIR]` runs each server
under bench/serve_trace.py and sets every first-sweep request's TTFT (and every in-stream gap over 0.5 s) beside
what the server's threads did meanwhile (bench/first_contact_trace.py: the result's "trace" per level).

The committed result: python bench/serving.py --first-contact --warmup fast,full --max-model-len 256
--json bench/results/serving_first_contact.json (the feature sweep's prompt is ~170 tokens once the chat template
renders the tool: 256 holds it and 32 more, 128 does not; a cold `full` at 256 compiles 196 warm-up jobs first).
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench import common
from bench import serving as sv

GOAL_RATIO = 1.5
GOAL_MAX_GAP_S = 1.0
READY_TIMEOUT_S = 3600.0  # a cold `--warmup full` compiles the whole grid before /ready
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "summary", "schema": {
    "type": "object", "properties": {"topic": {"type": "string"}, "lines": {"type": "integer"}},
    "required": ["topic", "lines"]}}}


@dataclass(frozen=True)
class FirstContactSpec:
    """concurrencies: the sweep's client counts; requests per concurrency = max(min_requests, rounds x c);
    prompt_tokens / output_tokens: the user text's token count and max_tokens; levels: the `--warmup` levels, each
    a fresh server; max_model_len: the servers' context window; compile_cache: the persistent cache folder (None:
    serve's default, as a user has it; "off": --no-compile-cache); trace: None, or run each server under
    bench/serve_trace.py and attribute each first-sweep request (bench/first_contact_trace.py), keeping the raw
    traces in that folder unless it is ""."""

    concurrencies: tuple[int, ...] = (1, 4, 16)
    rounds: int = 2
    min_requests: int = 8
    prompt_tokens: int = 64
    output_tokens: int = 32
    levels: tuple[str, ...] = ("fast",)
    max_model_len: int = 512
    compile_cache: str | None = None
    request_timeout: float = 600.0
    seed: int = 0
    trace: str | None = None


SMOKE = FirstContactSpec(concurrencies=(2,), rounds=1, min_requests=2, prompt_tokens=16, output_tokens=4,
                         max_model_len=256)


@dataclass(frozen=True)
class Stream:
    """One streamed chat completion as the client saw it: times in seconds from the sweep start."""

    ok: bool
    sent: float
    chunk_times: tuple[float, ...]
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str | None
    error: str | None = None


def prompt_texts(n: int, tokens: int, seed: int, stream: np.ndarray) -> list[str]:
    """n texts of `tokens` tiny-kimi tokens each: random windows of the held-out corpus, decoded."""
    from jaxserve.tokenizer import Tokenizer
    from tools.train_tiny import TOKENIZER_DIR

    tok = Tokenizer(TOKENIZER_DIR)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - tokens, size=n)
    return [tok.decode(stream[s:s + tokens].tolist()) for s in starts]


def chat_body(model: str, text: str, spec: FirstContactSpec, features: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": spec.output_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    if features:
        return {**body, "tools": TOOLS, "tool_choice": "auto", "response_format": SCHEMA, "logprobs": True,
                "top_logprobs": 5}
    return {**body, "ignore_eos": True}


def chat_stream(port: int, body: dict, t_base: float, timeout: float) -> Stream:
    """POST one streaming chat completion to 127.0.0.1:port; timestamp every chunk that carries a token (seconds
    after t_base, time.monotonic: the traced server's clock)."""
    sent = time.monotonic() - t_base
    times: list[float] = []
    usage, finish = None, None
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Stream(False, sent, (), 0, 0, None, f"HTTP {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            now = time.monotonic() - t_base
            line = line.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                return Stream(False, sent, tuple(times), 0, 0, None, f"stream error: {obj['error']}")
            usage = obj.get("usage") or usage
            for choice in obj.get("choices") or ():
                delta = choice.get("delta") or {}
                if any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
                    times.append(now)
                finish = choice.get("finish_reason") or finish
        conn.close()
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        return Stream(False, sent, tuple(times), 0, 0, None, f"{type(e).__name__}: {e}")
    if usage is None or not times:
        return Stream(False, sent, tuple(times), 0, 0, finish, f"no usage or no token chunk ({len(times)} chunks)")
    return Stream(True, sent, tuple(times), usage["completion_tokens"], usage["prompt_tokens"], finish)


def sweep(port: int, bodies: list[dict], concurrency: int, timeout: float) -> tuple[list[Stream], float, float]:
    """Fixed concurrency: `concurrency` clients, each sending the next body when its last stream ended.
    -> (streams, seconds, the time.monotonic() their times count from)."""
    t_base = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        streams = list(pool.map(lambda b: chat_stream(port, b, t_base, timeout), bodies))
    return streams, time.monotonic() - t_base, t_base


def p50_p99(xs: list[float]) -> dict[str, float | None]:
    """p50 and p99 in milliseconds (None when empty)."""
    if not xs:
        return {"p50_ms": None, "p99_ms": None}
    a = np.asarray(xs) * 1000.0
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


def row(streams: list[Stream], seconds: float, concurrency: int) -> dict:
    ok = [s for s in streams if s.ok]
    gaps = [[b - a for a, b in zip(s.chunk_times, s.chunk_times[1:])] for s in ok]
    max_gap = max((max(g) for g in gaps if g), default=0.0)
    tokens = sum(s.completion_tokens for s in ok)
    return {"concurrency": concurrency, "requests": len(streams), "completed": len(ok),
            "errors": [s.error for s in streams if not s.ok][:3], "duration_s": seconds,
            "prompt_tokens_mean": float(np.mean([s.prompt_tokens for s in ok])) if ok else None,
            "completion_tokens": tokens, "output_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "finish_reasons": sorted({str(s.finish_reason) for s in ok}),
            "ttft": p50_p99([s.chunk_times[0] - s.sent for s in ok]), "itl": p50_p99([x for g in gaps for x in g]),
            "ttft_ms_by_send": [round((s.chunk_times[0] - s.sent) * 1000.0, 1)
                                for s in sorted(ok, key=lambda s: s.sent)],
            "max_gap_ms": max_gap * 1000.0, "gaps_over_1s": sum(x > GOAL_MAX_GAP_S for g in gaps for x in g)}


def cache_size(folder: Path | None) -> dict[str, int]:
    files = [p for p in folder.rglob("*") if p.is_file()] if folder is not None and folder.exists() else []
    return {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}


def cache_flags(spec: FirstContactSpec) -> tuple[tuple[str, ...], Path | None]:
    """serve's cache flags and the folder they use (None: no cache)."""
    from jaxserve.engine.compile_cache import default_cache_dir

    if spec.compile_cache == "off":
        return ("--no-compile-cache",), None
    folder = Path(spec.compile_cache) if spec.compile_cache else default_cache_dir()
    return ("--compile-cache", str(folder)), folder


def run_sweeps(port: int, model: str, spec: FirstContactSpec, stream: np.ndarray) -> tuple[list[dict], list[dict]]:
    """The four sweeps (plain and features, first and warm) over every concurrency -> (their rows, and per sweep and
    concurrency its streams and time base, for the trace's attribution)."""
    sweeps, raw = [], []
    for features in (False, True):
        workload = "tools+json_schema+top_logprobs" if features else "plain"
        for i, name in enumerate(("first", "warm")):
            rows = []
            for c in spec.concurrencies:
                n = max(spec.min_requests, spec.rounds * c)
                seed = spec.seed + 1000 * (2 * features + i) + c
                bodies = [chat_body(model, t, spec, features) for t in prompt_texts(n, spec.prompt_tokens, seed, stream)]
                streams, seconds, t_base = sweep(port, bodies, c, spec.request_timeout)
                rows.append(row(streams, seconds, c))
                raw.append({"workload": workload, "pass": name, "c": c, "t_base": t_base, "streams": streams})
            sweeps.append({"workload": workload, "pass": name, "rows": rows})
    return sweeps, raw


def run_level(level: str, spec: FirstContactSpec, stream: np.ndarray, tmp: Path) -> dict:
    """A fresh server at one --warmup level: start-up times, then the four sweeps (`run_sweeps`); with spec.trace
    the server runs under bench/serve_trace.py and the result gains its attribution ("trace")."""
    flags, folder = cache_flags(spec)
    before = cache_size(folder)
    load_before = os.getloadavg()
    log = tmp / f"serve-{level}.log"
    trace = Path(spec.trace or tmp) / f"trace-{level}-{time.strftime('%H%M%S')}.jsonl"
    t0 = time.monotonic()
    proc, port = sv.start_server(sv.bench_checkpoint(None, tmp)[0], 2 * max(spec.concurrencies) + 8, log,
                                 ("--warmup", level, "--max-model-len", str(spec.max_model_len),
                                  "--max-queue", str(2 * max(spec.concurrencies)), *flags),
                                 ("-m", "bench.serve_trace", str(trace)) if spec.trace is not None else ())
    listening = time.monotonic() - t0
    try:
        sv.wait_ready(proc, port, log, READY_TIMEOUT_S)
        ready = time.monotonic() - t0
        model = sv.get_json("127.0.0.1", port, "/v1/models")["data"][0]["id"]
        sweeps, raw = run_sweeps(port, model, spec, stream)
        health = sv.get_json("127.0.0.1", port, "/health")
    finally:
        sv.stop_server(proc)
    warm_line = [ln for ln in log.read_text().splitlines() if "warm-up" in ln and "XLA programs" in ln]
    out = {"warmup": level, "spawn_to_listening_s": listening, "spawn_to_ready_s": ready,
           "warmup_log": warm_line[-1] if warm_line else None, "compile_cache": str(folder) if folder else None,
           "cache_before": before, "cache_after": cache_size(folder), "load_before": load_before,
           "load_after": os.getloadavg(), "sweeps": sweeps, "ratios": ratios(sweeps), "health_after": health}
    if spec.trace is not None:
        from bench import first_contact_trace

        out["trace"] = first_contact_trace.attribute(trace, raw, t0 + ready)
    return out


def ratios(sweeps: list[dict]) -> dict[str, dict[str, float | None]]:
    """Per workload and concurrency: first pass TTFT p99 / warm pass TTFT p99."""
    out: dict[str, dict[str, float | None]] = {}
    for first, warm in zip(sweeps[::2], sweeps[1::2]):
        out[first["workload"]] = {str(a["concurrency"]): a["ttft"]["p99_ms"] / b["ttft"]["p99_ms"]
                                  if a["ttft"]["p99_ms"] and b["ttft"]["p99_ms"] else None
                                  for a, b in zip(first["rows"], warm["rows"])}
    return out


def goals(level: dict) -> dict[str, bool]:
    rs = [r for w in level["ratios"].values() for r in w.values()]
    return {"ttft_p99_first_over_warm_le_1.5": all(r is not None and r <= GOAL_RATIO for r in rs),
            "no_gap_over_1s": all(r["gaps_over_1s"] == 0 for s in level["sweeps"] for r in s["rows"])}


def uptime() -> str | None:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip() if shutil.which("uptime") else None


def run(spec: FirstContactSpec, command: str, partial: Path | None = None) -> dict:
    """Every level in turn; after each, the result so far is written to `partial` (a later level may take long)."""
    stream = sv.corpus_tokens()
    r = {"bench": "serving_first_contact", "command": command, "machine": common.machine(), "spec": asdict(spec),
         "uptime_before": uptime(), "levels": {}, "goals": {"ttft_p99_ratio_max": GOAL_RATIO,
                                                            "max_gap_s": GOAL_MAX_GAP_S},
         "notes": "client and server share the host; a token is an SSE chunk with content, reasoning_content or "
                  "tool_calls; the feature sweep has no ignore_eos (its grammar may end the answer)"}
    with tempfile.TemporaryDirectory() as td:
        for level in spec.levels:
            r["levels"][level] = run_level(level, spec, stream, Path(td))
            r["levels"][level]["goals"] = goals(r["levels"][level])
            r["uptime"] = uptime()
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(r, indent=1) + "\n")
    return r


def table(r: dict) -> str:
    f = lambda x: "-" if x is None else f"{x:8.0f}"  # noqa: E731
    lines = []
    for level, res in r["levels"].items():
        load = f"load {res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}"
        lines.append(f"--warmup {level}: listening {res['spawn_to_listening_s']:.1f} s, ready "
                     f"{res['spawn_to_ready_s']:.1f} s ({load}); goals {res['goals']}")
        lines.append(f"  {'workload':<31} {'pass':<5} {'c':>3} {'ok':>5} {'TTFTp50':>8} {'TTFTp99':>8} {'ITLp50':>8} "
                     f"{'ITLp99':>8} {'maxgap':>8} {'ratio':>6}")
        for s in res["sweeps"]:
            for row_ in s["rows"]:
                c = row_["concurrency"]
                ratio = res["ratios"][s["workload"]].get(str(c)) if s["pass"] == "first" else None
                done = f"{row_['completed']:>2}/{row_['requests']:<2}"
                lines.append(f"  {s['workload']:<31} {s['pass']:<5} {c:>3} {done} "
                             f"{f(row_['ttft']['p50_ms'])} {f(row_['ttft']['p99_ms'])} {f(row_['itl']['p50_ms'])} "
                             f"{f(row_['itl']['p99_ms'])} {f(row_['max_gap_ms'])} "
                             f"{'' if ratio is None else f'{ratio:6.2f}'}")
        if "trace" in res:
            tr = res["trace"]
            lines.append(f"  trace: {tr['timeline']}")
            lines += [f"  miss {m['workload']} c={m['c']} #{m['i']}: {m['ttft_ms']} ms: {m['cause']}" for m in tr["misses"]]
            lines += [f"  gap {g['workload']} {g['pass']} c={g['c']} #{g['i']}: {g['gap_ms']} ms: {g['cause']}"
                      for g in tr["gaps"]]
    return "\n".join(lines + ["  (ms; ratio: first-pass TTFT p99 / warm-pass TTFT p99)"])


def main(levels: tuple[str, ...], smoke: bool, max_model_len: int | None, compile_cache: str | None,
         json_out: Path, command: str, trace: str | None = None) -> int:
    spec = SMOKE if smoke else FirstContactSpec()
    spec = FirstContactSpec(**{**asdict(spec), "levels": levels, "compile_cache": compile_cache,
                               "max_model_len": max_model_len or spec.max_model_len, "trace": trace})
    r = run(spec, command, json_out)
    return common.write_result(r, table(r), json_out)
