"""Session affinity over several engine workers: requests with the same session id go to the same worker, so
their shared prefixes hit that worker's prefix cache. New sessions and session-less requests go to the least
loaded worker. The router offers the Engine calls the server uses (submit, abort, validate, encode, stats)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from jaxserve.engine.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.request import Request, TokenEvent
from jaxserve.engine.warmup import WarmupLevel, WarmupReport
from jaxserve.errors import ConfigError


class SessionRouter:
    def __init__(self, workers: Sequence[Engine], max_sessions: int = 100_000) -> None:
        if not workers:
            raise ConfigError("a router needs at least one worker", value=len(workers), param="workers")
        self.workers = list(workers)
        self.cfg = workers[0].cfg
        self.model_cfg = workers[0].model_cfg
        self.tokenizer = workers[0].tokenizer
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session -> worker, LRU-bounded
        self._owner: dict[str, int] = {}  # request id -> worker, while in flight
        self._max_sessions = max_sessions
        self._lock = threading.Lock()

    @classmethod
    def replicas(cls, path: str, cfg: EngineConfig, n: int) -> SessionRouter:
        """n data-parallel replicas of a checkpoint, each an Engine on its own cfg.devices devices (replica i on
        jax.devices()[i * cfg.devices : (i + 1) * cfg.devices]): n weight copies on n disjoint device slices,
        so session affinity keeps a session's prefix cache on the replica that holds it."""
        import dataclasses

        return cls([Engine.from_checkpoint(path, dataclasses.replace(cfg, first_device=i * cfg.devices))
                    for i in range(n)])

    def _load(self, i: int) -> int:
        s = self.workers[i].stats()
        return int(s["running"] + s["waiting"])

    def worker_for(self, session_id: str | None) -> int:
        """The worker index a request of `session_id` goes to (sticky once chosen)."""
        with self._lock:
            if session_id is not None and session_id in self._sessions:
                self._sessions.move_to_end(session_id)
                return self._sessions[session_id]
            assigned = [0] * len(self.workers)
            for w in self._sessions.values():
                assigned[w] += 1
            # least loaded; ties go to the worker holding fewer sessions, so idle workers share new sessions
            i = min(range(len(self.workers)), key=lambda j: (self._load(j), assigned[j]))
            if session_id is not None:
                self._sessions[session_id] = i
                if len(self._sessions) > self._max_sessions:
                    self._sessions.popitem(last=False)
            return i

    def validate(self, req: Request) -> None:
        self.workers[0].validate(req)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.workers[0].encode(prompt)

    def submit(self, req: Request) -> Iterator[TokenEvent]:
        i = self.worker_for(req.session_id)
        stream = self.workers[i].submit(req)
        with self._lock:
            self._owner[req.request_id] = i
        return self._track(req.request_id, stream)

    def _track(self, rid: str, stream: Iterator[TokenEvent]) -> Iterator[TokenEvent]:
        try:
            yield from stream
        finally:
            with self._lock:
                self._owner.pop(rid, None)

    def abort(self, request_id: str) -> None:
        with self._lock:
            i = self._owner.get(request_id)
        if i is not None:
            self.workers[i].abort(request_id)

    def stats(self) -> dict[str, float]:
        per = [w.stats() for w in self.workers]
        return {k: sum(s[k] for s in per) for k in per[0]}

    def warm_up(self, level: WarmupLevel, progress: bool = False) -> WarmupReport:
        """Each worker's `Engine.warm_up`, one after the other; their counts added up."""
        total = WarmupReport(level)
        for w in self.workers:
            r = w.warm_up(level, progress)
            total.jobs = {k: total.jobs.get(k, 0) + r.jobs.get(k, 0) for k in {**total.jobs, **r.jobs}}
            total.backend_compiles += r.backend_compiles
            total.cache_hits += r.cache_hits
            total.seconds += r.seconds
            total.evictions += r.evictions
        return total

    def close(self) -> None:
        for w in self.workers:
            w.close()
