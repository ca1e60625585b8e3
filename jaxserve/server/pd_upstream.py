"""One server behind `jaxserve router`, as the router talks to it: HTTP/1.1 over the standard library's
http.client, one connection per request (a stream holds its connection until it ends).

Every socket has a timeout, so nothing waits forever on a server that stopped answering: `connect_s` to connect,
then `read_s` per read (the longest gap allowed between a stream's chunks, or before a whole answer). A server
that dies closes its sockets and the read fails at once; one that hangs is cut (`Upstream.cut`) when the health
checks declare it dead. Failures surface as typed errors naming the server: BackendUnreachableError (nothing was
sent: the router may try another server) and BackendError (the request failed mid-way).
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from jaxserve.errors import BackendError, BackendUnreachableError, ConfigError

READ_BYTES = 65536
# the response headers relayed to the client (hop-by-hop and framing headers are the router's own)
RELAYED_HEADERS = ("content-type", "retry-after", "cache-control", "x-accel-buffering", "x-jaxserve-ignored-fields")


@dataclass(frozen=True)
class Timeouts:
    """Seconds. connect_s: to open a connection; read_s: per read of an answer; probe_s: a health check's whole
    exchange."""

    connect_s: float = 5.0
    read_s: float = 300.0
    probe_s: float = 3.0


def parse_url(url: str) -> tuple[str, int]:
    """'http://host:port' -> (host, port); the router speaks plain HTTP to its servers."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ConfigError(f"a server URL is http://host:port, got {url!r}", value=url, param="url")
    return parts.hostname, parts.port or 80


class Answer:
    """A server's response as it arrives: status, the headers worth relaying, the body by chunks. Close it (or read
    it to the end) to free its connection."""

    def __init__(self, upstream: Upstream, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self.upstream = upstream
        self.status = resp.status
        self.headers = {k.lower(): v for k, v in resp.getheaders() if k.lower() in RELAYED_HEADERS}
        self._conn, self._resp = conn, resp
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, fn: Callable[[], None]) -> None:
        """Run `fn` once when the answer is closed (read to its end, broken off, or closed by its reader)."""
        self._on_close.append(fn)

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives (each read returns what the socket has, so SSE events pass through as they
        come). Raises BackendError if the server closes or stalls before the body is complete."""
        try:
            while chunk := self._resp.read1(READ_BYTES):
                yield chunk
            if self._resp.length:  # a Content-Length body cut short (a chunked one raises IncompleteRead)
                raise http.client.IncompleteRead(b"", self._resp.length)
        except (OSError, http.client.HTTPException) as e:
            raise self.upstream.failure(e) from e
        finally:
            self.close()

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def json(self) -> Any:
        body = self.read()
        try:
            return json.loads(body)
        except ValueError as e:
            raise BackendError(f"server {self.upstream.url} answered {self.status} with a body that is not JSON: "
                               f"{body[:200]!r}", value=self.upstream.url) from e

    def close(self) -> None:
        self.upstream.forget(self._conn)
        self._conn.close()
        callbacks, self._on_close = self._on_close, []
        for fn in callbacks:
            fn()


class Upstream:
    """One server: its URL, requests to it, and the connections its requests hold open (so a server declared dead
    can be cut loose at once)."""

    def __init__(self, url: str, timeouts: Timeouts = Timeouts()) -> None:
        self.host, self.port = parse_url(url)
        self.url = f"http://{self.host}:{self.port}"
        self.timeouts = timeouts
        self._open: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()
        self.cut_reason: str | None = None  # why the last cut() closed this server's connections

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
                read_s: float | None = None) -> Answer:
        """Send a request; returns once the status and headers are in. Raises BackendUnreachableError when the
        connection cannot be opened (nothing was sent), BackendError when the exchange fails after that."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeouts.connect_s)
        try:
            conn.connect()
        except OSError as e:
            conn.close()
            raise BackendUnreachableError(f"server {self.url} is unreachable: {_why(e)}", value=self.url) from e
        conn.sock.settimeout(self.timeouts.read_s if read_s is None else read_s)
        with self._lock:
            self._open.add(conn)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            return Answer(self, conn, conn.getresponse())
        except (OSError, http.client.HTTPException) as e:
            self.forget(conn)
            conn.close()
            raise self.failure(e) from e

    def probe(self, method: str, path: str, payload: Any = None) -> tuple[int, Any]:
        """A small JSON exchange under the probe timeout -> (status, parsed body or None if not JSON)."""
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        answer = self.request(method, path, body, headers, read_s=self.timeouts.probe_s)
        data = answer.read()
        try:
            return answer.status, json.loads(data)
        except ValueError:
            return answer.status, None

    def failure(self, e: BaseException) -> BackendError:
        """The typed error for an exchange that broke (names the server, and why it was cut if it was)."""
        why = f"cut by the router: {self.cut_reason}" if self.cut_reason else _why(e)
        return BackendError(f"server {self.url} failed mid-answer: {why}", value=self.url)

    def forget(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._open.discard(conn)

    def in_flight_connections(self) -> int:
        with self._lock:
            return len(self._open)

    def cut(self, reason: str) -> int:
        """Shut down every open connection to this server (their reads fail at once) -> how many."""
        self.cut_reason = reason
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            try:
                if conn.sock is not None:
                    conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its own thread
        return len(conns)

    def revived(self) -> None:
        self.cut_reason = None


def _why(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, http.client.IncompleteRead):
        return "the connection closed before the answer was complete"
    if isinstance(e, http.client.RemoteDisconnected):
        return "the connection closed without an answer"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
