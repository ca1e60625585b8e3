"""The HTTP layer's limits and request lifetime: `AppConfig`, the bounds on a request body's fields, the admission
gate (`Admission`: at most `max_inflight` generation requests, the next one refused 429 at once) and the
`DisconnectWatcher` that aborts in the engine a non-streaming request whose client went away."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.errors import QueueFullError

MAX_BODY_BYTES = 4 << 20  # far above any prompt that fits a context window; bounds JSON parsing work
MAX_STOP_STRINGS = 16
MAX_TOOLS = 128
RETRY_AFTER_S = 1
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 1024  # chat's default, bounded so a request without max_tokens cannot hold a slot for long
DISCONNECT_POLL_S = 0.05
MAX_DEPTH = 64  # JSON nesting; deeper bodies would overflow the recursive walks (here, the template's tojson)
MAX_N = 16  # choices per request: each is a sequence in the engine
MAX_PROMPTS = 64  # a batched completion's prompts x n: each choice is a sequence in the engine
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_CACHE_SALT_CHARS = 1024
STORED_RESPONSES = 1024  # /v1/responses answers kept for previous_response_id (oldest evicted first)
STORED_RESPONSE_TTL_S = 3600.0  # and for at most this long


@dataclass(frozen=True)
class AppConfig:
    """The HTTP layer's limits. max_inflight: generation requests admitted at once (each holds a WSGI thread until it
    ends: the server needs more threads than this, so /health and refusals always find one). strict_fields: refuse
    (400) a body field no schema here knows, instead of ignoring it and naming it in a response header.
    stored_responses, stored_response_ttl_s: how many /v1/responses answers `previous_response_id` reaches, how long."""

    max_inflight: int = 16
    max_body_bytes: int = MAX_BODY_BYTES
    default_chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS
    retry_after_s: int = RETRY_AFTER_S
    strict_fields: bool = False
    stored_responses: int = STORED_RESPONSES
    stored_response_ttl_s: float = STORED_RESPONSE_TTL_S


class Admission:
    """At most `limit` generation requests in flight; the next one is refused at once (429), never queued in the
    WSGI layer."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)

    def enter(self) -> None:
        if not self._free.acquire(blocking=False):
            raise QueueFullError(f"{self.limit} requests in flight (the server's admission limit)", value=self.limit,
                                 param="max_inflight")

    def leave(self) -> None:
        self._free.release()


class DisconnectWatcher:
    """Aborts in the engine the non-streaming requests whose client went away (a stream notices on its next write;
    a blocking request writes nothing until it ends). One polling thread, alive only while something is watched."""

    def __init__(self, abort: Callable[[str], None], poll_s: float = DISCONNECT_POLL_S) -> None:
        self._abort = abort
        self._poll_s = poll_s
        self._watched: dict[str, Callable[[], bool]] = {}
        self._aborts: dict[str, Callable[[str], None]] = {}
        self._gone: set[str] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, rid: str, disconnected: Callable[[], bool],
              abort: Callable[[str], None] | None = None) -> None:
        """Watch `rid`; `abort` (default: the engine's abort of rid) ends it when its client goes away."""
        with self._lock:
            self._watched[rid] = disconnected
            if abort is not None:
                self._aborts[rid] = abort
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxserve-disconnects", daemon=True)
                self._thread.start()

    def unwatch(self, rid: str) -> bool:
        """Stop watching; True if the request was aborted because its client disconnected."""
        with self._lock:
            self._watched.pop(rid, None)
            self._aborts.pop(rid, None)
            if rid in self._gone:
                self._gone.discard(rid)
                return True
            return False

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._watched:
                    self._thread = None
                    return
                gone = [rid for rid, disconnected in self._watched.items()
                        if rid not in self._gone and disconnected()]
                self._gone.update(gone)
            for rid in gone:
                with self._lock:
                    abort = self._aborts.get(rid, self._abort)
                abort(rid)
            time.sleep(self._poll_s)
