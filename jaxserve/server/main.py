"""`jaxserve serve`: load a checkpoint into an Engine (its own thread) and serve the HTTP API on waitress.

waitress (a production WSGI server) writes each SSE chunk to the socket as soon as the app yields it: its
`send_bytes` default is 1 byte in waitress 3, so token streams are never held back in an output buffer.

Admission: the engine's queue bound (`--max-queue`, EngineConfig.max_queue) is also the app's admission limit, and
waitress gets more worker threads than that (`--threads`, default max-queue + 4; given alone, --threads sets
max-queue to threads - 4), so every admitted request has a thread and the spare ones answer /health and the 429s at once: overload never queues inside waitress.
Bodies over `--max-body-bytes` are refused by waitress from the Content-Length header, before the body is read,
with a 413 in the OpenAI error shape.
CPU hosts: `--cpu-layout` (default auto: the layout bench/cpu_cores.py measured best for the core count, see
server/cpu_layout.py) sets the XLA CPU device count before JAX starts, and the engine's devices, sharding, replicas.
Compiled programs persist across restarts in the XLA compilation cache (`--compile-cache DIR`, default under the
user cache dir; `--no-compile-cache` turns it off).

Start-up: the weights load, the server listens (`/health` answers 200: live), then `--warmup` compiles ahead of
traffic in a background thread (`engine.warmup`: full, fast or none; one progress bar, and a log line of what came
from the compile cache), runs what it compiled once (`engine.priming`) and short start-up requests
(`first_request`; `first_feature_request`: tools, json_schema, top_logprobs); `/ready` (and `/health?ready=1`)
answers 503 until that is done. A warm-up that fails (e.g. `full` over the memory-mapping budget with no compile
cache to drop programs to) ends the process at once with its error on one line and exit code 2, rather than leave a
server that is never ready.
Shutdown: SIGTERM or SIGINT starts a drain (`Lifecycle.drain`): generation requests get 503 + Retry-After and
`/ready` fails at once; what is in flight may finish for `--drain-timeout` seconds, then the rest are aborted (a
stream's last event is an error saying so, then `data: [DONE]`); once their bytes are out the server stops and the
process exits 0. A second signal while draining is ignored.
"""
from __future__ import annotations

import _thread
import argparse
import ctypes
import ctypes.util
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flask import Flask
from waitress.channel import HTTPChannel
from waitress.server import BaseWSGIServer, MultiSocketServer, create_server
from waitress.task import ErrorTask

from jaxserve.engine import Engine, EngineConfig, Request, SamplingParams, heap
from jaxserve.engine.compile_cache import add_cache_arguments, enable_from_args
from jaxserve.errors import ConfigError, JaxserveError
from jaxserve.format_names import canonical_format
from jaxserve.engine.warmup import WARMUP_LEVELS
from jaxserve.server.cpu_layout import CPU_LAYOUTS, CpuLayout, resolve, usable_cores
from jaxserve.server.limits import DEFAULT_CHAT_MAX_TOKENS, MAX_BODY_BYTES, AppConfig, Lifecycle

SPARE_THREADS = 4  # beyond the admission limit: /health, /metrics and refusals never wait for a stream to end
MALLOC_ARENAS = 2  # glibc makes up to 8 x cores heap arenas; each request thread's garbage would pin its own
M_ARENA_MAX = -8  # mallopt parameter number (malloc.h)
DRAIN_TIMEOUT_S = 30.0
STARTUP_PROMPT = [{"role": "user", "content": "Hello"}]  # `first_request`'s, before ready
STARTUP_TOKENS = 2
STARTUP_SALT = "jaxserve-startup"
STARTUP_TOOLS = [{"type": "function", "function": {"name": "startup", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}]
STARTUP_SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
# `first_feature_request`'s bodies: a streamed tools + json_schema + top_logprobs request, a whole forced tool call
STARTUP_BODIES = (
    {"tools": STARTUP_TOOLS, "tool_choice": "auto", "logprobs": True, "top_logprobs": 5, "stream": True,
     "response_format": {"type": "json_schema", "json_schema": {"name": "startup", "schema": STARTUP_SCHEMA}}},
    {"tools": STARTUP_TOOLS, "tool_choice": "required", "stream": False})
FLUSH_WAIT_S = 5.0  # after the drain: how long the last events may take to leave the sockets


@dataclass(frozen=True)
class ServeConfig:
    """Where and how wide to listen. threads bounds concurrent HTTP requests (each stream holds one): keep it above
    the app's admission limit (AppConfig.max_inflight) by SPARE_THREADS."""

    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 16 + SPARE_THREADS
    max_body_bytes: int = MAX_BODY_BYTES


class JsonErrorTask(ErrorTask):
    """waitress's own refusals (413 body too large, 400 malformed HTTP, ...) in the OpenAI error shape."""

    def execute(self) -> None:
        e = self.request.error
        body = json.dumps({"error": {"message": f"{e.reason}: {e.body}", "type": "invalid_request_error",
                                     "param": None, "code": None}}).encode()
        self.status = f"{e.code} {e.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class JsonErrorChannel(HTTPChannel):
    error_task_class = JsonErrorTask


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="a converted checkpoint (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=None,
                   help="generation requests admitted at once (queued or running); the next gets 429 + Retry-After "
                        f"(default 16, or --threads - {SPARE_THREADS})")
    p.add_argument("--threads", type=int, default=None,
                   help=f"HTTP worker threads (default: --max-queue + {SPARE_THREADS}; must exceed --max-queue)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger request bodies get 413")
    p.add_argument("--strict-fields", action="store_true",
                   help="refuse (400) request fields this server does not know, instead of ignoring them and naming "
                        "them in the x-jaxserve-ignored-fields response header")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="chat completion length when the request sets none (default 1024, within the window)")
    p.add_argument("--kv-dtype", type=canonical_format, choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--decode-weights", type=canonical_format, choices=["int4", "fp8", "bf16"], default="int4")
    p.add_argument("--prefill-weights", type=canonical_format, choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--integrity", choices=["on", "off"], default="on", help="KV page generation-tag checks")
    p.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                   help="prefill and decode as separate servers (PD_PROTOCOL.md): 'prefill' runs prompts and serves "
                        "their KV pages on the transfer port, 'decode' pulls them and generates; 'both' does all")
    p.add_argument("--transfer-host", default="127.0.0.1", help="--role prefill: the KV transfer service's address")
    p.add_argument("--transfer-port", type=int, default=0, help="--role prefill: its port (0: a free port)")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--cpu-layout", choices=CPU_LAYOUTS, default="auto",
                   help="on a CPU host, how the cores are used: single = one XLA device, sched = one device with "
                        "XLA:CPU's concurrency-optimized scheduler, tp / dp = one device per "
                        "core (tensor parallel / DP attention), workers = one engine replica per core; auto = the "
                        "layout measured best for the core count (README, 'Every core'). No effect on GPU/TPU")
    p.add_argument("--cpu-cores", type=int, default=None,
                   help="cores the CPU layout spreads over (default: those this process may run on)")
    p.add_argument("--workers", type=int, default=1,
                   help="data-parallel replicas, each on its own --devices devices; a x-session-affinity session sticks to one")
    p.add_argument("--max-model-len", type=int, default=2048, help="context window (prompt + completion)")
    p.add_argument("--warmup", choices=WARMUP_LEVELS, default="fast",
                   help="what compiles before /ready: full = every program the serving config can select (nothing "
                        "compiles after ready; past half of vm.max_map_count memory mappings they are dropped to the "
                        "compile cache and load from it on first use; once the cache holds them all, a restart loads "
                        "the fast set before ready and the rest from the cache as fast does), fast = the "
                        "largest shape of each kind, the rest in a low-priority background thread while smaller steps "
                        "run padded in a compiled shape, none = nothing (default fast)")
    p.add_argument("--max-maps", type=int, default=None,
                   help="memory mappings the process may hold before compiled programs are dropped to the compile "
                        "cache (full warm-up, and between engine steps after ready; default half of vm.max_map_count)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="batch-invariant outputs: greedy and seeded requests give the same tokens whatever else "
                        "runs (rows computed in fixed-shape tiles, no preemption; see README for the cost: 45%% "
                        "of a lone stream's speed here); --no-deterministic: off (default)")
    p.add_argument("--speculative", default=None, metavar="METHOD:K[:MAX_ROWS]",
                   help="speculative decoding: draft K tokens per step and verify them in one forward; ngram:K "
                        "(prompt lookup), mtp:K (the checkpoint's MTP head) or eagle3:PATH:K (an EAGLE-3 draft "
                        "checkpoint folder); with MAX_ROWS, only while at most that many requests decode (default off)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="on SIGTERM/SIGINT: seconds in-flight requests may finish before they are aborted")
    add_cache_arguments(p)


def admission(args: argparse.Namespace) -> tuple[int, int]:
    """(max_queue, threads), configured together: refuse a thread count that would queue admitted work in waitress."""
    max_queue = args.max_queue
    if max_queue is None:
        max_queue = args.threads - SPARE_THREADS if args.threads is not None else 16
    if max_queue < 1:
        raise ConfigError("--max-queue must be at least 1", value=max_queue, param="max_queue")
    threads = args.threads if args.threads is not None else max_queue + SPARE_THREADS
    if threads <= max_queue:
        raise ConfigError(f"--threads ({threads}) must exceed --max-queue ({max_queue}): admitted requests "
                          "would hold every thread and /health and 429s would wait", value=threads, param="threads")
    return max_queue, threads


def engine_config(args: argparse.Namespace, layout: CpuLayout | None = None) -> EngineConfig:
    """The engine's config from the flags; on a CPU host `layout` sets its devices and sharding."""
    devices, sharding = (args.devices, "tp") if layout is None else (layout.devices, layout.sharding)
    return EngineConfig(kv_dtype=args.kv_dtype, decode_weights=args.decode_weights,
                        prefill_weights=args.prefill_weights, integrity=args.integrity == "on",
                        devices=devices, sharding=sharding, max_model_len=args.max_model_len,
                        max_queue=admission(args)[0], deterministic=args.deterministic, role=args.role,
                        speculative=args.speculative, transfer_host=args.transfer_host,
                        transfer_port=args.transfer_port, max_maps=args.max_maps)


def start_jax(args: argparse.Namespace) -> CpuLayout | None:
    """Create the XLA CPU devices the CPU layout needs (before JAX starts: the device count is fixed then; on an
    accelerator host they are unused), start JAX, and return the layout for its platform (None off CPU)."""
    import jax

    cores = args.cpu_cores if args.cpu_cores is not None else usable_cores()
    want = resolve(args.cpu_layout, cores, "cpu", args.devices, args.workers)
    if want.xla_flags:  # read when the backend starts (below): an accelerator host ignores the CPU flags
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {want.xla_flags}".strip()
    jax.config.update("jax_num_cpu_devices", want.cpu_devices)
    layout = resolve(args.cpu_layout, cores, jax.default_backend(), args.devices, args.workers)
    if layout is not None:
        _say(f"CPU layout {layout.name}: {layout.workers} engine(s) x {layout.devices} device(s), {cores} cores")
    return layout


def model_name(checkpoint: str | Path) -> str:
    """The `model` clients send: the checkpoint folder's name (`tiny-kimi` for the embedded model)."""
    return Path(checkpoint).resolve().name


def make_server(app: Flask, cfg: ServeConfig) -> BaseWSGIServer | MultiSocketServer:
    """A waitress server bound to cfg.host:cfg.port (port 0: a free port, see `.effective_port`); call `.run()`."""
    # channel_request_lookahead keeps a busy connection readable, so waitress sees a client hang up mid-request
    # (environ["waitress.client_disconnected"]) and the app aborts its generation
    server = create_server(app, host=cfg.host, port=cfg.port, threads=cfg.threads, ident="jaxserve",
                           clear_untrusted_proxy_headers=True, max_request_body_size=cfg.max_body_bytes,
                           channel_request_lookahead=1)
    listeners = [server] if isinstance(server, BaseWSGIServer) else \
        [s for s in server.map.values() if isinstance(s, BaseWSGIServer)]
    for s in listeners:
        s.channel_class = JsonErrorChannel
    return server


def cap_malloc_arenas(n: int = MALLOC_ARENAS) -> None:
    """Bound glibc's heap arenas (like MALLOC_ARENA_MAX=n), so memory freed after a large request is reusable by
    every thread; call before the server threads start. A no-op without glibc. (malloc_trim after large requests
    was measured and dropped: it locks every arena while it runs and stalled other streams by ~35 ms, and RSS
    returns without it because oversized text is refused before it is tokenized.)"""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is not None:
        mallopt(M_ARENA_MAX, n)


class Shutdown:
    """SIGTERM / SIGINT handling: the first signal drains in a thread (the main thread keeps waitress's loop
    running, which writes the streams' last bytes); once drained and flushed the thread signals again and that
    signal ends the loop."""

    def __init__(self, lifecycle: Lifecycle, server: BaseWSGIServer | MultiSocketServer, timeout_s: float) -> None:
        self.lifecycle = lifecycle
        self.server = server
        self.timeout_s = timeout_s
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.failure: Exception | None = None  # a warm-up that failed: the process ends with it

    def fail(self, error: Exception) -> None:
        """The warm-up failed (it will never be ready): end the server loop at once, nothing to drain."""
        self.failure = error
        self.done.set()  # so the signal below ends waitress's loop instead of starting a drain
        _thread.interrupt_main(signal.SIGTERM)

    def on_signal(self, signum: int, frame: object) -> None:
        if self.done.is_set():
            raise SystemExit(0)  # waitress's loop ends on SystemExit
        if self.thread is None:
            _say(f"signal {signum}: draining (in-flight requests may finish for {self.timeout_s:g} s)")
            self.thread = threading.Thread(target=self._drain, name="jaxserve-drain", daemon=True)
            self.thread.start()

    def _drain(self) -> None:
        try:
            aborted = self.lifecycle.drain(self.timeout_s)
            _say(f"drained: {aborted} request(s) aborted at the timeout")
            deadline = time.monotonic() + FLUSH_WAIT_S
            while _unsent(self.server) and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            self.done.set()
            _thread.interrupt_main(signal.SIGTERM)  # handled on the main thread: ends waitress's loop


def _say(line: str) -> None:
    print(f"jaxserve: {line}", file=sys.stderr, flush=True)


def _unsent(server: BaseWSGIServer | MultiSocketServer) -> int:
    """Bytes waitress still holds for its connections' sockets."""
    channels = server.map if isinstance(server, MultiSocketServer) else server._map
    return sum(getattr(ch, "total_outbufs_len", 0) for ch in list(channels.values()))


def first_request(engine: Engine) -> None:
    """One short greedy request (STARTUP_PROMPT through the chat template when the checkpoint has one; 2 tokens) on
    each engine's thread before ready: even with every program run once (`engine.priming`) a first request costs
    ~1.5x a later one (host paths used for the first time; bench/first_execution.py). Its own cache salt: no
    client's prompt hits its prefix-cache pages. It counts in the engine's stats. Not on a prefill / decode server
    (no whole request runs there)."""
    if engine.cfg.role != "both":
        return
    tok = engine.tokenizer
    text = tok.apply_chat_template(STARTUP_PROMPT) if tok is not None and tok.chat_template else None
    for worker in getattr(engine, "workers", [engine]):  # `--workers`: every replica's thread
        prompt = worker.encode(text) if text is not None else list(range(1, 9))  # no template: a few ids
        req = Request(prompt, SamplingParams(max_tokens=STARTUP_TOKENS), cache_salt=STARTUP_SALT)
        for _ in worker.submit(req):
            pass


def first_feature_request(engine: Engine) -> None:
    """STARTUP_BODIES (2 tokens each) through a private app over the engine (its own metrics; the Flask test client,
    no socket) before ready: a first request with tools, a response_format or top_logprobs otherwise pays the first
    use of llguidance (its tokenizer's build, a grammar's compile, a first mask), of the tools' chat template and of
    the logprob and tool-call response paths (bench/first_grammar.py). Each worker's grammar tokenizer is built.
    Its own cache salt; the requests count in the engine's stats. Not on a prefill / decode server, nor without a
    chat template. A refused body is logged, not raised: serving does not depend on it."""
    tok = engine.tokenizer
    if engine.cfg.role != "both" or tok is None or not tok.chat_template:
        return
    from jaxserve.server.app import create_app

    for worker in getattr(engine, "workers", [engine]):
        if worker.grammar is not None:
            worker.grammar.prepare()
    client = create_app(engine, STARTUP_SALT).test_client()
    for extra in STARTUP_BODIES:
        body = {"model": STARTUP_SALT, "messages": STARTUP_PROMPT, "max_tokens": STARTUP_TOKENS,
                "cache_salt": STARTUP_SALT, **extra}
        r = client.post("/v1/chat/completions", json=body)
        text = r.get_data(as_text=True)  # a stream runs while it is read
        if r.status_code != 200:
            logging.getLogger(__name__).warning("start-up request refused (%d): %s", r.status_code, text[:300])


def start_warmup(engine: Engine, level: str, lifecycle: Lifecycle, progress: bool = True,
                 on_error: Callable[[Exception], None] | None = None) -> threading.Thread:
    """Warm the engine up in a daemon thread (returned); the lifecycle becomes ready when it is done. A failed
    warm-up calls on_error (serve: the process exits with the error), or raises in the thread without one."""
    def warm() -> None:
        try:
            report = engine.warm_up(level, progress)
            t0, line = time.monotonic(), report.line()
            if level != "none":
                first_request(engine)
                first_feature_request(engine)
                heap.freeze()  # what they built (grammar tokenizers, templates) lives on too (engine.heap)
                line += f"; start-up requests {time.monotonic() - t0:.2f} s"
        except Exception as e:
            if on_error is None:
                raise
            on_error(e)
            return
        _say(line)
        lifecycle.set_ready()

    thread = threading.Thread(target=warm, name="jaxserve-warmup", daemon=True)
    thread.start()
    return thread


def _transfer_line(engine: object) -> str:
    """Where a prefill server's KV transfer service listens, for the start-up line ("" for other roles)."""
    transfers = getattr(engine, "transfers", None)
    return "" if transfers is None else ", KV transfers on {}:{}".format(*transfers.address)


def run(args: argparse.Namespace) -> int:
    from jaxserve.cli import default_checkpoint
    from jaxserve.server.app import create_app

    cap_malloc_arenas()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    max_queue, threads = admission(args)  # before loading: a bad flag fails at once, not after the weights load
    serve_cfg = ServeConfig(args.host, args.port, threads, args.max_body_bytes)
    enable_from_args(args)  # before anything compiles: a restart loads its programs instead of compiling them
    checkpoint = Path(args.checkpoint) if args.checkpoint else default_checkpoint()
    layout = start_jax(args)
    workers = args.workers if layout is None else layout.workers
    if workers > 1 and args.role != "both":
        raise ConfigError("--workers replicates a --role both server; run one process per prefill / decode server",
                          value=workers, param="workers")
    if workers > 1:
        from jaxserve.engine.router import SessionRouter

        # data-parallel replicas, each on its own slice of --devices devices
        engine = SessionRouter.replicas(checkpoint, engine_config(args, layout), workers)
    else:
        engine = Engine.from_checkpoint(checkpoint, engine_config(args, layout), start=True)
    name = model_name(checkpoint)
    app_cfg = AppConfig(max_inflight=max_queue, max_body_bytes=args.max_body_bytes,
                        default_chat_max_tokens=args.default_max_tokens or DEFAULT_CHAT_MAX_TOKENS,
                        strict_fields=args.strict_fields)
    lifecycle = Lifecycle(max_queue, ready=False)
    server = make_server(create_app(engine, name, app_cfg, lifecycle), serve_cfg)
    shutdown = Shutdown(lifecycle, server, args.drain_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):  # what process managers send, and Ctrl-C
        signal.signal(sig, shutdown.on_signal)
    print(f"jaxserve: serving {name} on http://{args.host}:{server.effective_port}/v1 (admits {max_queue} "
          f"requests, {serve_cfg.threads} threads; warm-up {args.warmup}: /ready answers 200 once done; role "
          f"{args.role}{_transfer_line(engine)})", file=sys.stderr, flush=True)
    try:
        start_warmup(engine, args.warmup, lifecycle, on_error=shutdown.fail)  # restarts load from the compile cache
        server.run()  # returns once drained (waitress catches the SystemExit of the last signal)
    except SystemExit:
        if shutdown.failure is None:
            raise  # (a failed warm-up's signal may come before waitress's loop runs)
    finally:
        server.close()
        engine.close()
    if shutdown.failure is not None:  # cli.main prints a JaxserveError as one line and exits 2
        e = shutdown.failure
        raise e if isinstance(e, JaxserveError) else JaxserveError(f"warm-up {args.warmup} failed: {e!r}")
    return 0
