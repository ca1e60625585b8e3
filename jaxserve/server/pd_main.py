"""`jaxserve router --prefill URL... [--decode URL...]`: the OpenAI-compatible front end over prefill and decode
servers (`server.pd_router`), served by waitress like `jaxserve serve`.

It reads the checkpoint's tokenizer, chat template and model config (not its weights) to tokenize prompts as the
servers do. Each stream holds one of its `--threads` worker threads while it lasts. SIGTERM / SIGINT stop it
(streams in flight end with the connection).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from jaxserve.server.limits import MAX_BODY_BYTES, AppConfig
from jaxserve.server.main import ServeConfig, cap_malloc_arenas, make_server, model_name
from jaxserve.server.pd_fleet import Fleet, HealthConfig
from jaxserve.server.pd_policy import PolicyConfig
from jaxserve.server.pd_upstream import Timeouts

DEFAULT_THREADS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                   help="prefill servers (`jaxserve serve --role prefill`), or servers of --role both that take "
                        "whole requests when no --decode server is given")
    p.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                   help="decode servers (`jaxserve serve --role decode`)")
    p.add_argument("--checkpoint", default=None,
                   help="the servers' checkpoint: its tokenizer and config only (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="HTTP worker threads (one per open stream)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger request bodies get 413")
    p.add_argument("--health-interval", type=float, default=HealthConfig.interval_s,
                   help="seconds between health checks of each server")
    p.add_argument("--fail-after", type=int, default=HealthConfig.fail_after,
                   help="failed health checks in a row before a server is dead (a refused connection: at once)")
    p.add_argument("--connect-timeout", type=float, default=Timeouts.connect_s)
    p.add_argument("--read-timeout", type=float, default=Timeouts.read_s,
                   help="seconds a server may go silent mid-answer (between a stream's events) before it fails")
    p.add_argument("--max-queue-gap", type=int, default=PolicyConfig.max_queue_gap,
                   help="a cached prefix draws a request to a server at most this many queued requests deeper")


def run(args: argparse.Namespace) -> int:
    from jaxserve.checkpoint import load_config
    from jaxserve.cli import default_checkpoint
    from jaxserve.server.pd_router import RouterConfig, create_router_app
    from jaxserve.tokenizer import Tokenizer

    cap_malloc_arenas()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    checkpoint = Path(args.checkpoint) if args.checkpoint else default_checkpoint()
    timeouts = Timeouts(args.connect_timeout, args.read_timeout, Timeouts.probe_s)
    fleet = Fleet(args.prefill, args.decode, timeouts, HealthConfig(args.health_interval, args.fail_after))
    name = model_name(checkpoint)
    cfg = RouterConfig(name, AppConfig(max_body_bytes=args.max_body_bytes), PolicyConfig(args.max_queue_gap))
    app = create_router_app(fleet, Tokenizer(checkpoint), load_config(checkpoint), cfg)
    server = make_server(app, ServeConfig(args.host, args.port, args.threads, args.max_body_bytes))

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)  # waitress's loop ends on SystemExit

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    fleet.start(first_wait_s=timeouts.connect_s + timeouts.probe_s)
    mode = f"{len(args.decode)} decode" if args.decode else "no decode (whole requests)"
    print(f"jaxserve router: routing {name} on http://{args.host}:{server.effective_port}/v1 over "
          f"{len(args.prefill)} prefill + {mode} servers", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        server.close()
        fleet.close()
    return 0
