"""The KV transfer service between a prefill server and a decode server (PD_PROTOCOL.md): a TCP socket service
(stdlib `socketserver`) with length-prefixed binary frames, the documented fallback of `jax.experimental.transfer`.

Why the fallback is the implementation: in the pinned jax (0.10.2) `jax.experimental.transfer` imports and a pull
between two transfer servers works on CPU, but a pull of an id nobody offers returns arrays that block forever
when read (no timeout, no cancel, no error), so a dead or restarted prefill server would hang the decode side's
request for good; a socket gives each pull a timeout and a typed failure.

Frames: an 8-byte big-endian length, then the payload. A pull is one connection:
  decode -> prefill: JSON {"transfer_id"}
  prefill -> decode: JSON header {"ok", "num_pages", "group_pages", "fields": [[name, dtype, shape per page]],
                     "chunk_tags", "src_tags", "checksums"} (or {"ok": false, "error"}), then for each group of
                     `group_pages` pages, one frame per field: its bits [layers, pages in group, ...] in C order.
The pages are already in the decode pool's format (FP8 + scales when it is FP8), converted on the prefill device;
the prefill side copies one group at a time to the host, the decode side fills one host buffer of the request's
pages (at most max_pages_per_seq), so both sides' memory stays bounded.
"""
from __future__ import annotations

import json
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxserve.errors import KVTransferError

FRAME = struct.Struct(">Q")
MAX_HEADER_BYTES = 64 << 20  # checksums and tags of the longest request fit far below this
MAX_GROUP_PAGES = 16


def send_frame(sock: socket.socket, payload: bytes | memoryview) -> None:
    sock.sendall(FRAME.pack(len(payload)))
    sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    """Exactly n bytes (into `into` when given); a closed connection raises KVTransferError."""
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise KVTransferError(f"the KV transfer connection closed after {got} of {n} bytes of a frame", value=got,
                                  param="kv_transfer_params")
        got += k
    return buf


def recv_frame_len(sock: socket.socket) -> int:
    return FRAME.unpack(recv_exact(sock, FRAME.size))[0]


def recv_json(sock: socket.socket) -> dict[str, Any]:
    n = recv_frame_len(sock)
    if n > MAX_HEADER_BYTES:
        raise KVTransferError(f"a KV transfer header of {n} bytes is over the limit", value=n,
                              param="kv_transfer_params")
    try:
        obj = json.loads(bytes(recv_exact(sock, n)))
    except ValueError as err:
        raise KVTransferError(f"a KV transfer header is not JSON: {err}", param="kv_transfer_params") from err
    if not isinstance(obj, dict):
        raise KVTransferError("a KV transfer header is not a JSON object", param="kv_transfer_params")
    return obj


def group_pages(bucket: int) -> int:
    """Pages per streamed group: the largest power of two dividing the chunk's padded size, at most
    MAX_GROUP_PAGES (so every group is one fixed-size slice of the chunk: one compiled slice program)."""
    return min(MAX_GROUP_PAGES, bucket & -bucket)


@dataclass(frozen=True)
class Offer:
    """What the prefill side serves for one transfer: `fields` name -> a group reader (start page -> host array
    [layers, group_pages, ...]), and the header (num_pages, fields, tags, checksums)."""

    header: dict[str, Any]
    read_group: Callable[[str, int], np.ndarray]


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: TransferServer = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.settimeout(server.timeout_s)
        try:
            tid = recv_json(sock).get("transfer_id")
            offer = server.take(tid) if isinstance(tid, str) else None
            if offer is None:
                send_frame(sock, json.dumps({"ok": False, "error": f"unknown or expired transfer id {tid!r}"}).encode())
                return
            send_frame(sock, json.dumps(offer.header).encode())
            n, g = offer.header["num_pages"], offer.header["group_pages"]
            for start in range(0, n, g):
                for name, _, _ in offer.header["fields"]:
                    send_frame(sock, memoryview(np.ascontiguousarray(offer.read_group(name, start)[:, : n - start]))
                               .cast("B"))
        except (OSError, KVTransferError):
            return  # the decode side sees the broken stream and fails its request; the offer is gone either way


class TransferServer(socketserver.ThreadingTCPServer):
    """The prefill side's listener: `take(transfer_id) -> Offer | None` hands over (and forgets) one export."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, take: Callable[[str], Offer | None], timeout_s: float) -> None:
        super().__init__((host, port), _Handler)
        self.take = take
        self.timeout_s = timeout_s
        self.thread = threading.Thread(target=self.serve_forever, name="jaxserve-kv-transfer", daemon=True)
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        self.shutdown()
        self.server_close()


@dataclass(frozen=True)
class Pulled:
    """A pull's result on the decode side: the pages' fields as host arrays [layers, num_pages, ...] (padded to
    `bucket` pages), the header's tags and checksums, and the payload bytes received."""

    fields: dict[str, np.ndarray]
    chunk_tags: np.ndarray
    src_tags: list[int]
    checksums: np.ndarray
    num_pages: int
    payload_bytes: int


def pull(host: str, port: int, transfer_id: str, expected: dict[str, tuple[str, tuple[int, ...]]],
         bucket: Callable[[int], int], timeout_s: float) -> Pulled:
    """Fetch one transfer. expected: field -> (dtype, shape of one layer-stacked page [layers, 1, ...]) in the decode
    pool's layout; a header naming other fields or shapes is refused. Raises KVTransferError (timeouts, refused or
    broken connections, a bad header)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            send_frame(sock, json.dumps({"transfer_id": transfer_id}).encode())
            return _receive(sock, expected, bucket)
    except OSError as err:  # refused, reset, timed out
        raise KVTransferError(f"KV transfer {transfer_id!r} from {host}:{port} failed: {err}", value=transfer_id,
                              param="kv_transfer_params") from err


def _receive(sock: socket.socket, expected: dict[str, tuple[str, tuple[int, ...]]],
             bucket: Callable[[int], int]) -> Pulled:
    head = recv_json(sock)
    if not head.get("ok"):
        raise KVTransferError(f"the prefill server refused the KV transfer: {head.get('error')}",
                              param="kv_transfer_params")
    n, g = int(head["num_pages"]), int(head["group_pages"])
    fields = {name: (dtype, tuple(shape)) for name, dtype, shape in head["fields"]}
    if fields != expected or not 0 < n <= bucket(n) or g < 1:
        raise KVTransferError(f"the KV transfer's pages ({fields}, {n} pages) do not match this decode pool's "
                              f"layout ({expected})", value=n, param="kv_transfer_params")
    out = {name: np.zeros((shape[0], bucket(n), *shape[2:]), dtype) for name, (dtype, shape) in fields.items()}
    received = 0
    for start in range(0, n, g):
        k = min(g, n - start)
        for name, buf in out.items():
            part = buf[:, start: start + k]
            size = part.nbytes
            if recv_frame_len(sock) != size:
                raise KVTransferError(f"KV transfer frame of field {name} has the wrong size", param=name)
            staged = np.empty(part.shape, part.dtype)
            recv_exact(sock, size, memoryview(staged).cast("B"))
            part[...] = staged
            received += size
    return Pulled(out, np.asarray(head["chunk_tags"], np.uint32), [int(t) for t in head["src_tags"]],
                  np.asarray(head["checksums"], np.uint32), n, received)
