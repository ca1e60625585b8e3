"""`jaxserve serve`: load a checkpoint into an Engine (its own thread) and serve the HTTP API on waitress.

waitress (a production WSGI server) writes each SSE chunk to the socket as soon as the app yields it: its
`send_bytes` default is 1 byte in waitress 3, so token streams are never held back in an output buffer.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from flask import Flask
from waitress.server import BaseWSGIServer, MultiSocketServer, create_server

from jaxserve.engine import Engine, EngineConfig


@dataclass(frozen=True)
class ServeConfig:
    """Where and how wide to listen. threads bounds concurrent HTTP requests (each stream holds one)."""

    host: str = "127.0.0.1"
    port: int = 8000
    threads: int = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="a converted checkpoint (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=16, help="HTTP worker threads (concurrent requests/streams)")
    p.add_argument("--kv-dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--decode-weights", choices=["int4", "fp8", "bf16"], default="int4")
    p.add_argument("--prefill-weights", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--integrity", choices=["on", "off"], default="on", help="KV page generation-tag checks")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--workers", type=int, default=1,
                   help="engine workers; requests with the same x-session-affinity header stick to one")
    p.add_argument("--max-model-len", type=int, default=2048, help="context window (prompt + completion)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(kv_dtype=args.kv_dtype, decode_weights=args.decode_weights,
                        prefill_weights=args.prefill_weights, integrity=args.integrity == "on",
                        devices=args.devices, max_model_len=args.max_model_len)


def model_name(checkpoint: str | Path) -> str:
    """The `model` clients send: the checkpoint folder's name (`tiny-kimi` for the embedded model)."""
    return Path(checkpoint).resolve().name


def make_server(app: Flask, cfg: ServeConfig) -> BaseWSGIServer | MultiSocketServer:
    """A waitress server bound to cfg.host:cfg.port (port 0: a free port, see `.effective_port`); call `.run()`."""
    return create_server(app, host=cfg.host, port=cfg.port, threads=cfg.threads, ident="jaxserve",
                         clear_untrusted_proxy_headers=True)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    from jaxserve.cli import default_checkpoint
    from jaxserve.server.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    checkpoint = Path(args.checkpoint) if args.checkpoint else default_checkpoint()
    engine = Engine.from_checkpoint(checkpoint, engine_config(args), start=True)
    if args.workers > 1:
        from jaxserve.engine.router import SessionRouter

        engine = SessionRouter([engine] + [Engine(engine.model, engine.cfg, engine.tokenizer)
                                           for _ in range(args.workers - 1)])
    name = model_name(checkpoint)
    server = make_server(create_app(engine, name), ServeConfig(args.host, args.port, args.threads))
    # SIGTERM (what process managers send) shuts down like Ctrl-C: waitress's loop ends on SystemExit
    signal.signal(signal.SIGTERM, _exit_on_signal)
    print(f"jaxserve: serving {name} on http://{args.host}:{server.effective_port}/v1", file=sys.stderr, flush=True)
    try:
        server.run()  # returns after Ctrl-C / SIGTERM (waitress catches KeyboardInterrupt and SystemExit)
    finally:
        server.close()
        engine.close()
    return 0
