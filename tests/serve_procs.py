"""Servers for multi-server tests: `jaxserve serve` processes on 127.0.0.1 (the embedded model, free ports, a
shared XLA compile cache) and a `jaxserve router` app on a waitress thread in the test process."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from jaxserve.checkpoint import load_config
from jaxserve.cli import default_checkpoint
from jaxserve.server.main import ServeConfig, make_server
from jaxserve.server.pd_fleet import Fleet, HealthConfig
from jaxserve.server.pd_router import RouterConfig, create_router_app
from jaxserve.server.pd_upstream import Timeouts
from jaxserve.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 180.0
MODEL = "tiny-kimi"  # the embedded checkpoint's folder name: what clients send as `model`


@dataclass
class ServeProc:
    """A `jaxserve serve` (or `router`) process and its stderr lines (kept for failure messages)."""

    proc: subprocess.Popen
    base: str
    log: list[str] = field(default_factory=list)

    def kill(self) -> None:
        """SIGKILL: the process dies with its sockets, as a crashed server would."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def text(self) -> str:
        return "".join(self.log)


def start_serve(cache_dir: Path, *args: str) -> ServeProc:
    """`jaxserve serve --port 0 --warmup none` with `args`; returns once it listens."""
    return start_jaxserve("serve", "--port", "0", "--warmup", "none", "--compile-cache", str(cache_dir), *args)


def start_jaxserve(*args: str) -> ServeProc:
    """`jaxserve <args>` (serve or router); returns once its start-up line names the URL it listens on."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", *args], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    log: list[str] = []
    found = threading.Event()
    base: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            log.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if m and not found.is_set():
                base.append(m.group(1))
                found.set()
        found.set()  # the process ended: stop waiting

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(START_TIMEOUT) or not base:
        proc.kill()
        raise AssertionError(f"jaxserve {args[0]} did not start: {''.join(log)}")
    return ServeProc(proc, base[0], log)


@dataclass
class RouterThread:
    """A router app on a waitress thread over `fleet`."""

    fleet: Fleet
    server: object
    thread: threading.Thread

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server.effective_port}"

    def close(self) -> None:
        self.server.close()
        self.server.task_dispatcher.shutdown(timeout=5)
        self.fleet.close()


def start_router(prefill: list[str], decode: list[str], health_s: float = 0.2) -> RouterThread:
    """A router over the given servers (the embedded model's tokenizer), its health checked every health_s."""
    checkpoint = default_checkpoint()
    fleet = Fleet(prefill, decode, Timeouts(connect_s=5.0, read_s=120.0, probe_s=5.0), HealthConfig(health_s, 2))
    app = create_router_app(fleet, Tokenizer(checkpoint), load_config(checkpoint), RouterConfig(MODEL))
    server = make_server(app, ServeConfig("127.0.0.1", 0, threads=48))
    fleet.start(first_wait_s=30.0)
    thread = threading.Thread(target=server.run, name="router-test", daemon=True)
    thread.start()
    return RouterThread(fleet, server, thread)
