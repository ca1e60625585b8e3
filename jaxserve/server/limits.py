"""The HTTP layer's limits and request lifetime: `AppConfig`, the bounds on a request body's fields, the admission
gate (`Admission`: at most `max_inflight` generation requests, the next one refused 429 at once), the server's
`Lifecycle` (ready, draining, the admitted requests) and the `DisconnectWatcher` that aborts in the engine a request
whose client went away."""
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


def once(fn: Callable[[], None]) -> Callable[[], None]:
    """`fn` called on the first call only, from whichever thread comes first."""
    done = threading.Event()
    lock = threading.Lock()

    def call() -> None:
        with lock:
            if done.is_set():
                return
            done.set()
        fn()

    return call


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
    WSGI layer. Counts what is in flight, so a drain can wait for it to end."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._n = 0
        self._cond = threading.Condition()

    def enter(self) -> None:
        with self._cond:
            if self._n >= self.limit:
                raise QueueFullError(f"{self.limit} requests in flight (the server's admission limit)",
                                     value=self.limit, param="max_inflight")
            self._n += 1

    def leave(self) -> None:
        with self._cond:
            self._n -= 1
            self._cond.notify_all()

    def once(self) -> Callable[[], None]:
        """A `leave` that acts on its first call only (a stream leaves on disconnect or on close, whichever is
        first)."""
        return once(self.leave)

    @property
    def in_flight(self) -> int:
        return self._n

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is in flight (True) or `timeout` seconds pass (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._n == 0, timeout)


class Lifecycle:
    """One server's state over its life: ready (its warm-up loaded what `--warmup` promises), draining (a shutdown
    began: nothing new is admitted, /ready fails), and its admitted requests, each with the call that aborts it."""

    def __init__(self, max_inflight: int, ready: bool = True) -> None:
        self.admission = Admission(max_inflight)
        self._ready = threading.Event()
        self._draining = threading.Event()
        self._live: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self.abort_reason = "the engine aborted this request"  # what an aborted request's answer says
        if ready:
            self._ready.set()

    def set_ready(self) -> None:
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._draining.is_set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def state(self) -> str:
        return "draining" if self.draining else "ready" if self._ready.is_set() else "warming up"

    def track(self, rid: str, abort: Callable[[], None]) -> None:
        with self._lock:
            self._live[rid] = abort

    def untrack(self, rid: str) -> None:
        with self._lock:
            self._live.pop(rid, None)

    def drain(self, timeout_s: float, grace_s: float = 10.0) -> int:
        """Stop admitting, let what is in flight finish for up to `timeout_s`, then abort the rest (their answers
        say why) and wait up to `grace_s` for them to end. Returns how many were aborted."""
        self._draining.set()
        if self.admission.wait_idle(timeout_s):
            return 0
        with self._lock:
            self.abort_reason = f"the server is shutting down: the drain timeout ({timeout_s:g} s) ended this request"
            aborts = list(self._live.values())
        for abort in aborts:
            abort()
        self.admission.wait_idle(grace_s)
        return len(aborts)


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
