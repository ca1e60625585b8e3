"""HTTP serving load generator (in the spirit of SGLang's bench_serving): TTFT, ITL, TPOT, throughput, errors.

Usage: python bench/serving.py [--quick | --smoke] [--url http://127.0.0.1:PORT] [--rate R | --concurrency C]
                               [--checkpoint DIR] --json OUT.json
       python bench/serving.py --pd P:D [--quick | --smoke] [--reps N] --json OUT.json   (bench/serving_pd.py)
       python bench/serving.py --first-contact [--smoke] [--warmup fast,full] [--max-model-len N]
                               [--compile-cache DIR|off] [--trace] --json OUT.json   (bench/serving_first_contact.py)

Without --url it starts `jaxserve serve` itself on 127.0.0.1 (a free port) in a child process, so the load
generator and the server do not share one Python interpreter, and stops it at the end. --url must be loopback.
Load: a fixed concurrency (C clients, each sending its next request when the last finished) or a fixed request
rate (Poisson arrivals: exponential gaps of mean 1/R). Prompts are windows of held-out stdlib text
(jaxserve.eval.corpus held-out split, tokenized with the tiny-kimi tokenizer) or random token ids; prompt and
output lengths are drawn uniformly from [lo, hi]. Every request streams (/v1/completions, stream=true,
logprobs=0 so every token arrives as its own SSE chunk, ignore_eos so the output length is exact).
TTFT: send -> first token chunk; ITL: gaps between token chunks; TPOT: (last - first) / (tokens - 1).
A warm-up pass with the same workload shape (different draws) runs first and is not counted: the server
compiles each new shape bucket on first use. Hard caps: --num-requests and --max-seconds (requests not started
by the deadline are not sent; in-flight ones get --request-timeout).
"""
from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import common  # noqa: E402


@dataclass(frozen=True)
class LoadSpec:
    """concurrency: clients (used when rate is None); rate: requests/s (Poisson); prompt_len/output_len: uniform
    [lo, hi] token counts; num_requests and max_seconds: hard caps of the measured pass; warmup_requests: the
    untimed pass before it; source: "corpus" (held-out text) or "random" token ids."""

    concurrency: int = 8
    rate: float | None = None
    prompt_len: tuple[int, int] = (32, 96)
    output_len: tuple[int, int] = (16, 32)
    num_requests: int = 64
    max_seconds: float = 240.0
    warmup_requests: int = 16
    request_timeout: float = 120.0
    source: str = "corpus"
    seed: int = 0


QUICK = LoadSpec(concurrency=8, num_requests=24, max_seconds=60.0, warmup_requests=8, output_len=(8, 16))
SMOKE = LoadSpec(concurrency=2, prompt_len=(8, 16), output_len=(2, 4), num_requests=4, max_seconds=60.0,
                 warmup_requests=2, source="random")


@dataclass(frozen=True)
class Result:
    """One request as the client saw it. Times are seconds from the pass start (send) and per-token arrivals."""

    ok: bool
    prompt_tokens: int
    requested_tokens: int
    output_tokens: int
    sent: float
    token_times: tuple[float, ...]
    done: float
    error: str | None = None



# ---------------------------------------------------------------------------------------------------- workload


def corpus_tokens(max_chars: int = 400_000) -> np.ndarray:
    """Held-out stdlib text (first files of the fixed split, up to max_chars) tokenized with the tiny tokenizer."""
    from jaxserve.eval import corpus
    from tools.train_tiny import TOKENIZER_DIR
    from jaxserve.tokenizer import Tokenizer

    tok = Tokenizer(TOKENIZER_DIR)
    texts, n = [], 0
    for text in corpus.read_texts(corpus.heldout_files()):
        texts.append(text)
        n += len(text)
        if n >= max_chars:
            break
    return np.array(tok.encode("\n".join(texts)), np.int32)


def workload(spec: LoadSpec, n: int, vocab: int, seed: int, stream: np.ndarray | None) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_tokens) pairs drawn from the spec's length ranges."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = int(rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1))
        o = int(rng.integers(spec.output_len[0], spec.output_len[1] + 1))
        if stream is not None and len(stream) > p:
            s = int(rng.integers(0, len(stream) - p))
            ids = stream[s:s + p].tolist()
        else:
            ids = rng.integers(1, vocab, size=p).tolist()
        out.append(([min(int(t), vocab - 1) for t in ids], o))
    return out


# ---------------------------------------------------------------------------------------------------- client


def one_request(host: str, port: int, model: str, prompt: list[int], max_tokens: int, t_base: float,
                timeout: float) -> Result:
    """Send one streaming completion and timestamp every token chunk (relative to t_base)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "logprobs": 0, "stream_options": {"include_usage": True}})
    sent = time.perf_counter() - t_base
    times: list[float] = []
    usage = None
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            msg = resp.read()[:300].decode("utf-8", "replace")
            conn.close()
            return Result(False, len(prompt), max_tokens, 0, sent, (), time.perf_counter() - t_base,
                          f"HTTP {resp.status}: {msg}")
        while True:
            line = resp.readline()
            if not line:
                break
            now = time.perf_counter() - t_base
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                conn.close()
                return Result(False, len(prompt), max_tokens, len(times), sent, tuple(times), now,
                              f"stream error: {obj['error'].get('message', obj['error'])}")
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("choices") and obj["choices"][0].get("logprobs") is not None:
                times.append(now)  # one chunk per token (logprobs=0 makes every token its own chunk)
        conn.close()
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        return Result(False, len(prompt), max_tokens, len(times), sent, tuple(times), time.perf_counter() - t_base,
                      f"{type(e).__name__}: {e}")
    done = time.perf_counter() - t_base
    n = usage["completion_tokens"] if usage else len(times)
    err = None if n == max_tokens == len(times) else f"got {len(times)} token chunks, usage {n}, wanted {max_tokens}"
    return Result(err is None, len(prompt), max_tokens, n, sent, tuple(times), done, err)


def run_pass(host: str, port: int, model: str, reqs: list[tuple[list[int], int]], spec: LoadSpec, seed: int,
             desc: str) -> tuple[list[Result], float]:
    """Drive one pass (fixed concurrency or Poisson rate) -> (results, seconds from start to last finish)."""
    results: list[Result] = []
    lock = threading.Lock()
    t_base = time.perf_counter()
    deadline = t_base + spec.max_seconds
    bar = tqdm(total=len(reqs), desc=desc, leave=False)

    def record(r: Result) -> None:
        with lock:
            results.append(r)
            bar.update(1)

    if spec.rate is None:
        nxt = iter(range(len(reqs)))

        def client() -> None:
            while time.perf_counter() < deadline:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                record(one_request(host, port, model, *reqs[i], t_base, spec.request_timeout))

        threads = [threading.Thread(target=client, daemon=True) for _ in range(spec.concurrency)]
        for t in threads:
            t.start()
    else:
        rng = np.random.default_rng(seed)
        threads = []
        at = 0.0
        for prompt, n in reqs:
            at += float(rng.exponential(1.0 / spec.rate))
            wait = t_base + at - time.perf_counter()
            if t_base + at >= deadline:
                break
            if wait > 0:
                time.sleep(wait)
            t = threading.Thread(target=lambda p=prompt, k=n: record(
                one_request(host, port, model, p, k, t_base, spec.request_timeout)), daemon=True)
            t.start()
            threads.append(t)
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.perf_counter()) + spec.request_timeout)
    bar.close()
    with lock:
        done = list(results)
    end = max((r.done for r in done), default=0.0)
    return done, end


def pct(xs: list[float]) -> dict[str, float | None]:
    """mean, p50, p95, p99 in milliseconds (None when empty)."""
    if not xs:
        return {"mean_ms": None, "p50_ms": None, "p95_ms": None, "p99_ms": None}
    a = np.asarray(xs) * 1000.0
    return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)),
            "p99_ms": float(np.percentile(a, 99))}


def summarize(results: list[Result], seconds: float, planned: int) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.token_times[0] - r.sent for r in ok if r.token_times]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    e2e = [r.done - r.sent for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {"planned": planned, "sent": len(results), "completed": len(ok), "errors": len(errors),
            "error_samples": errors[:5], "not_sent_by_deadline": planned - len(results), "duration_s": seconds,
            "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / seconds if seconds > 0 else 0.0,
            "request_throughput_per_s": len(ok) / seconds if seconds > 0 else 0.0,
            "ttft": pct(ttft), "itl": pct(itl), "tpot": pct(tpot), "e2e_latency": pct(e2e)}


# ---------------------------------------------------------------------------------------------------- server


def bench_checkpoint(checkpoint: Path | None, tmp: Path) -> tuple[Path, str]:
    """The given/embedded checkpoint, or a random tiny-kimi model exported and converted into tmp."""
    from jaxserve.cli import default_checkpoint

    ckpt = checkpoint or default_checkpoint()
    if (ckpt / "jaxserve.json").exists():
        return ckpt, ckpt.name
    if checkpoint is not None:
        raise SystemExit(f"{checkpoint} is not a jaxserve checkpoint (no jaxserve.json)")
    from flax import nnx

    from jaxserve.convert.converter import convert
    from tools.train_tiny import ModelSize, export_hf, hf_config_dict
    from jaxserve.config import from_hf_config
    from jaxserve.models import CausalLM

    raw = hf_config_dict(ModelSize())
    model = CausalLM(from_hf_config(raw), rngs=nnx.Rngs(0))
    export_hf(model, raw, tmp / "hf")
    return convert(tmp / "hf", tmp / "random-tiny-kimi", progress=False), "random tiny-kimi architecture"


def listening_port(log: Path) -> int | None:
    """The port a `jaxserve serve` printed in its log ("serving ... http://127.0.0.1:PORT/"), None before it has."""
    for line in log.read_text().splitlines():
        if "serving" in line and "http://127.0.0.1:" in line:
            return int(line.split("http://127.0.0.1:")[1].split("/")[0])
    return None


def is_ready(port: int) -> bool:
    """Whether GET /ready on 127.0.0.1:port answers 200 (the server's warm-up is done)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/ready")
        status = conn.getresponse().status
        conn.close()
        return status == 200
    except OSError:
        return False


def start_server(checkpoint: Path, threads: int, log: Path, extra: tuple[str, ...] = (),
                 launcher: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int]:
    """`jaxserve serve` on 127.0.0.1, port 0 (and `extra` flags) -> (process, the port it printed); launcher: the
    interpreter arguments before `-m jaxserve.cli` (e.g. bench.serve_trace's)."""
    cmd = [sys.executable, *launcher, "-m", "jaxserve.cli", "serve", "--checkpoint", str(checkpoint), "--host", "127.0.0.1",
           "--port", "0", "--threads", str(threads), "--max-model-len", "512", *extra]
    errf = log.open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=errf, text=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if (port := listening_port(log)) is not None:
            return proc, port
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("server did not start within 300 s")


def wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    """Until GET /ready answers 200 (the server's own warm-up is done); an exit or the timeout raises."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        if is_ready(port):
            return
        time.sleep(0.2)
    raise RuntimeError(f"port {port} not ready within {timeout_s:g} s")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM (jaxserve serve shuts down like Ctrl-C), then SIGKILL if it is still running after `timeout` s."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def get_json(host: str, port: int, path: str) -> dict:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    return body


def run(spec: LoadSpec, url: str | None, checkpoint: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        proc = None
        model_desc = "server at --url"
        if url is None:
            ckpt, model_desc = bench_checkpoint(checkpoint, tmp)
            proc, port = start_server(ckpt, max(64, 2 * spec.concurrency), tmp / "server.log")
            host = "127.0.0.1"
        else:
            u = urlparse(url)
            host, port = u.hostname or "", u.port or 80
            if host not in ("127.0.0.1", "localhost", "::1"):
                raise SystemExit("--url must be a loopback address (127.0.0.1 / localhost)")
        try:
            card = get_json(host, port, "/v1/models")["data"][0]
            name = card["id"]
            from tools.train_tiny import ModelSize

            vocab = ModelSize().vocab_size
            stream = corpus_tokens() if spec.source == "corpus" else None
            warm = workload(spec, spec.warmup_requests, vocab, spec.seed + 1, stream)
            run_pass(host, port, name, warm, replace(spec, max_seconds=max(spec.max_seconds, 120.0)),
                     spec.seed + 1, "warm-up")
            reqs = workload(spec, spec.num_requests, vocab, spec.seed, stream)
            results, seconds = run_pass(host, port, name, reqs, spec, spec.seed, "measured")
            health = get_json(host, port, "/health")
        finally:
            if proc is not None:
                stop_server(proc)
    s = summarize(results, seconds, len(reqs))
    return {"bench": "serving", "model": model_desc, "served_model": name, "server": "started by the bench"
            if url is None else url, "machine": common.machine(), "spec": asdict(spec),
            "mode": f"poisson rate {spec.rate}/s" if spec.rate else f"concurrency {spec.concurrency}",
            "summary": s, "health_after": health,
            "notes": "client and server on the same (shared, busy) CPU host; warm-up pass excluded; "
                     "logprobs=0 streams one SSE chunk per token"}


def table(r: dict) -> str:
    s = r["summary"]

    def row(name: str, d: dict) -> str:
        f = lambda x: "-" if x is None else f"{x:9.1f}"  # noqa: E731
        return f"  {name:<5} {f(d['mean_ms'])} {f(d['p50_ms'])} {f(d['p95_ms'])} {f(d['p99_ms'])}"

    return "\n".join([
        f"serving {r['served_model']} ({r['mode']}): {s['completed']}/{s['planned']} completed, {s['errors']} errors,"
        f" {s['not_sent_by_deadline']} not sent by the deadline, {s['duration_s']:.1f} s",
        f"  output tokens/s {s['output_tokens_per_s']:.1f}, requests/s {s['request_throughput_per_s']:.2f}",
        f"  {'ms':<5} {'mean':>9} {'p50':>9} {'p95':>9} {'p99':>9}",
        row("TTFT", s["ttft"]), row("ITL", s["itl"]), row("TPOT", s["tpot"]), row("E2E", s["e2e_latency"])])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="24 requests at concurrency 8 (about a minute)")
    mode.add_argument("--smoke", action="store_true", help="4 tiny requests (CI schema check)")
    ap.add_argument("--url", default=None, help="a running server (loopback only); default: start one")
    ap.add_argument("--checkpoint", type=Path, default=None)
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="Poisson request rate per second")
    load.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--max-seconds", type=float, default=None)
    ap.add_argument("--source", choices=["corpus", "random"], default=None)
    ap.add_argument("--pd", default=None, metavar="P:D",
                    help="compare P prefill + D decode servers behind a router with one --role both server on the "
                         "same devices (bench/serving_pd.py; takes --quick/--smoke, --reps, --checkpoint)")
    ap.add_argument("--reps", type=int, default=None, help="--pd: interleaved repetitions")
    ap.add_argument("--first-contact", action="store_true",
                    help="a fresh server per --warmup level, then chat sweeps at c = 1, 4, 16, first and warm, plain "
                         "and with tools + json_schema + top_logprobs (bench/serving_first_contact.py; takes --smoke)")
    ap.add_argument("--warmup", default="fast", help="--first-contact: serve --warmup levels, comma-separated")
    ap.add_argument("--max-model-len", type=int, default=None, help="--first-contact: the servers' window (512)")
    ap.add_argument("--compile-cache", default=None, metavar="DIR|off",
                    help="--first-contact: the servers' compile cache (default: serve's own default folder)")
    ap.add_argument("--trace", nargs="?", const="", default=None, metavar="DIR",
                    help="--first-contact: run each server under bench/serve_trace.py and attribute every first-sweep "
                         "request's TTFT to what its threads did (bench/first_contact_trace.py); DIR keeps the raw "
                         "traces")
    ap.add_argument("--json", dest="json_out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.first_contact:
        from bench import serving_first_contact

        command = "python bench/serving.py " + " ".join(sys.argv[1:] if argv is None else argv)
        return serving_first_contact.main(tuple(args.warmup.split(",")), args.smoke, args.max_model_len,
                                          args.compile_cache, args.json_out, command, args.trace)
    if args.pd is not None:
        from bench import serving_pd

        preset = "smoke" if args.smoke else "quick" if args.quick else "full"
        return serving_pd.main(args.pd, preset, args.checkpoint, args.reps, args.json_out)
    spec = SMOKE if args.smoke else QUICK if args.quick else LoadSpec()
    if args.rate is not None:
        spec = replace(spec, rate=args.rate)
    if args.concurrency is not None:
        spec = replace(spec, concurrency=args.concurrency, rate=None)
    if args.num_requests is not None:
        spec = replace(spec, num_requests=args.num_requests)
    if args.max_seconds is not None:
        spec = replace(spec, max_seconds=args.max_seconds)
    if args.source is not None:
        spec = replace(spec, source=args.source)
    r = run(spec, args.url, args.checkpoint)
    return common.write_result(r, table(r), args.json_out)


if __name__ == "__main__":
    sys.exit(main())
