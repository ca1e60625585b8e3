"""KV pages moved between processes (PD_PROTOCOL.md): the prefill side's `TransferStore` (exports held under a
transfer id until pulled or timed out, served by `kv_wire.TransferServer`) and the decode side's `Puller` (one thread
per pull, results handed to the scheduler).

The allocators belong to the scheduler's thread, so neither side frees a page here: the store queues the pages of
a taken or expired export (`releases`), the puller queues its results (`landed`), and the scheduler's step drains
both (`remote_steps`). A pull is single-shot: the export is forgotten when its pull starts, whatever happens next.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.cache import KVPages, init_pages
from jaxserve.cache.checksum import present_fields
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.kv_wire import Offer, Pulled, TransferServer, group_pages, pull
from jaxserve.engine.programs import Programs
from jaxserve.engine.sequence import Sequence
from jaxserve.errors import JaxserveError, KVTransferError

Pages = list[tuple[int, int]]


@dataclass(frozen=True)
class Export:
    """One held export: the compact chunk (decode format, on the prefill devices, padded) and its checksums
    [bucket, F] uint32 on the device, the prefill (page, tag) pairs it holds, and when it was made."""

    chunk: KVPages
    checksums: jax.Array
    pages: Pages
    created: float

    def offer(self) -> Offer:
        n = len(self.pages)
        bucket = int(self.chunk.tags.shape[0])
        g = group_pages(bucket)
        names = present_fields(self.chunk)
        fields = [[f, str(getattr(self.chunk, f).dtype), [getattr(self.chunk, f).shape[0], 1,
                                                           *getattr(self.chunk, f).shape[2:]]] for f in names]
        header = {"ok": True, "num_pages": n, "group_pages": g, "fields": fields,
                  "chunk_tags": np.asarray(self.chunk.tags)[:n].tolist(), "src_tags": [t for _, t in self.pages],
                  "checksums": np.asarray(self.checksums)[:n].tolist()}

        def read_group(name: str, start: int) -> np.ndarray:
            # a fixed-size dynamic slice: one compiled program whatever the start page
            return np.asarray(jax.lax.dynamic_slice_in_dim(getattr(self.chunk, name), start, g, axis=1))

        return Offer(header, read_group)


class TransferStore:
    """The prefill side's exports, at most cfg.max_transfers at once, each dropped cfg.transfer_timeout_s after it
    was made unless pulled first; serves them on its own `TransferServer` (started here)."""

    def __init__(self, cfg: EngineConfig, wake: Callable[[], None]) -> None:
        self.cfg = cfg
        self.wake = wake
        self._held: dict[str, Export] = {}
        self._released: list[Pages] = []
        self._lock = threading.Lock()
        self.server = TransferServer(cfg.transfer_host, cfg.transfer_port, self.take, cfg.transfer_timeout_s)

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def put(self, pages: Pages, chunk: KVPages, checksums: jax.Array) -> str:
        """Hold an export -> its transfer id. Raises KVTransferError when cfg.max_transfers are held."""
        with self._lock:
            if len(self._held) >= self.cfg.max_transfers:
                raise KVTransferError(f"{len(self._held)} KV exports wait to be pulled (max_transfers "
                                      f"{self.cfg.max_transfers})", value=len(self._held), param="max_transfers")
            tid = uuid.uuid4().hex
            self._held[tid] = Export(chunk, checksums, list(pages), time.monotonic())
        return tid

    def take(self, tid: str) -> Offer | None:
        """Hand one export to a pull (the transfer service's thread); its pages are queued for release."""
        with self._lock:
            export = self._held.pop(tid, None)
            if export is not None:
                self._released.append(export.pages)
        if export is None:
            return None
        self.wake()
        return export.offer()

    def drop(self, tid: str) -> None:
        """Forget an export nobody will pull (its request ended otherwise); its pages are queued for release."""
        with self._lock:
            export = self._held.pop(tid, None)
            if export is not None:
                self._released.append(export.pages)

    def has_work(self) -> bool:
        """Pages to release now (taken, dropped or expired exports): the engine loop steps for them."""
        with self._lock:
            return bool(self._released) or any(self._expired(e) for e in self._held.values())

    def releases(self) -> list[Pages]:
        """The page lists to free now (the scheduler's thread frees them), expired exports included."""
        with self._lock:
            for tid in [t for t, e in self._held.items() if self._expired(e)]:
                self._released.append(self._held.pop(tid).pages)
            out, self._released = self._released, []
        return out

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def _expired(self, export: Export) -> bool:
        return time.monotonic() - export.created > self.cfg.transfer_timeout_s

    def close(self) -> None:
        self.server.close()


class Puller:
    """The decode side's pulls: `start(seq)` fetches seq's pages on a thread (bounded by the scheduler's admission:
    one per request holding decode pages); `landed()` returns the finished ones as (seq, Pulled or the error)."""

    def __init__(self, programs: Programs, wake: Callable[[], None]) -> None:
        self.cfg = programs.cfg
        self.wake = wake
        one = jax.eval_shape(lambda: init_pages(programs.layouts.decode, 1))
        self.expected = {f: (str(getattr(one, f).dtype), tuple(getattr(one, f).shape)) for f in present_fields(one)}
        self._done: list[tuple[Sequence, Pulled | JaxserveError, float]] = []
        self._lock = threading.Lock()

    def start(self, seq: Sequence) -> None:
        threading.Thread(target=self._pull, args=(seq,), name="jaxserve-kv-pull", daemon=True).start()

    def _pull(self, seq: Sequence) -> None:
        spec = seq.req.pull
        t0 = time.monotonic()
        try:
            result: Pulled | JaxserveError = pull(spec.host, spec.port, spec.transfer_id, self.expected,
                                                  lambda n: self.cfg.pick(self.cfg.prefill_page_buckets, n),
                                                  self.cfg.transfer_timeout_s)
        except JaxserveError as err:
            result = err
        except Exception as err:  # noqa: BLE001 - any failure ends this request only, never the engine
            result = KVTransferError(f"KV transfer failed: {err!r}", value=spec.transfer_id, param="kv_transfer_params")
        with self._lock:
            self._done.append((seq, result, time.monotonic() - t0))
        self.wake()

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._done)

    def landed(self) -> list[tuple[Sequence, Pulled | JaxserveError, float]]:
        with self._lock:
            out, self._done = self._done, []
        return out


def chunk_of(pulled: Pulled, programs: Programs) -> KVPages:
    """A pulled chunk on the decode devices, shaped as `Programs.import_chunk` takes it."""
    tags = np.zeros(next(iter(pulled.fields.values())).shape[1], np.uint32)
    tags[: pulled.num_pages] = pulled.chunk_tags
    arrays = jax.device_put({**pulled.fields, "tags": tags}, programs.chunk_sharding())
    return KVPages(programs.layouts.decode, **arrays)
