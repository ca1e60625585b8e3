"""`jaxserve serve` under SIGTERM with 10 streams open: /ready fails and new requests get 503 at once, every stream
ends with a final event (aborted, saying why) and `data: [DONE]`, and the process exits 0 within the drain timeout
with no waitress thread left running."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parents[2]
DRAIN_S = 3.0
STREAMS = 10
TIMEOUT = 120.0


def start_serve(tmp_path: Path, *flags: str, timeout: float = TIMEOUT) -> tuple[subprocess.Popen, str, list[str]]:
    """`jaxserve serve` (embedded model, no warm-up, port 0, `flags` added) in a child process -> (process, its base
    URL once it listens, its stderr lines so far and to come)."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0", "--warmup", "none",
           "--compile-cache", str(tmp_path / "xla"), *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
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

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout):
        proc.kill()
        raise AssertionError("".join(log))
    return proc, base[0], log


def _stream(base: str, out: list[str], started: threading.Event) -> None:
    body = {"model": "tiny-kimi", "prompt": "def main():", "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as r:
        for line in r.iter_lines():
            if line:
                out.append(line)
                started.set()


def test_sigterm_drains_every_stream_to_a_final_event_and_exits_0(tmp_path):
    proc, base, log = start_serve(tmp_path, "--drain-timeout", str(DRAIN_S))
    try:
        outs = [[] for _ in range(STREAMS)]
        starts = [threading.Event() for _ in range(STREAMS)]
        readers = [threading.Thread(target=_stream, args=(base, o, s)) for o, s in zip(outs, starts)]
        for t in readers:
            t.start()
        assert all(s.wait(TIMEOUT) for s in starts)  # every stream has its first token
        proc.send_signal(signal.SIGTERM)
        # while draining: not ready, nothing new admitted, still live
        ready = httpx.get(f"{base}/ready", timeout=TIMEOUT)
        refused = httpx.post(f"{base}/v1/completions", json={"model": "tiny-kimi", "prompt": "x", "max_tokens": 1},
                             timeout=TIMEOUT)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        for t in readers:
            t.join(TIMEOUT)
        assert proc.wait(timeout=DRAIN_S + 30) == 0, "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for out in outs:
        assert out[-1] == "data: [DONE]", out[-3:]
        final = json.loads(out[-2].removeprefix("data: "))
        ended = final.get("choices") and final["choices"][0]["finish_reason"] is not None
        assert ended or "shutting down" in final["error"]["message"], final
    assert any("error" in json.loads(o[-2].removeprefix("data: ")) for o in outs)  # cut at the drain timeout
    assert not any("still running" in line for line in log), "".join(log)
