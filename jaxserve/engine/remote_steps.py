"""The scheduler's steps for prefill and decode as separate servers (`EngineConfig.role`, PD_PROTOCOL.md), a mixin
of `scheduler.Scheduler` (it uses the scheduler's pools, lists and failure paths):

prefill role: a finished prefill is not handed off; its first token is emitted and the request ends there. With
`Request.export_kv` its pages are first converted to the decode format and checksummed on the device and held in
the `TransferStore` (the pages stay allocated until pulled or timed out), and the finish event carries the
kv_transfer_params a decode server needs.
decode role: a request with `Request.pull` skips prefill: it gets decode pages for its prompt (tagged here), its
pages are pulled on a thread, imported with the prefill side's tags checked, checksummed again on the device and
compared (a byte changed in flight fails that request only), then it decodes from the first token prefill sampled.
Every failure (refused, broken or timed-out pull, checksum) ends only its request, and its pages return.
"""
from __future__ import annotations

import numpy as np

from jaxserve.engine.kv_transfer import Puller, TransferStore, chunk_of
from jaxserve.engine.kv_wire import Pulled
from jaxserve.engine.request import Status
from jaxserve.engine.sequence import Sequence
from jaxserve.errors import JaxserveError, KVTransferError, OutOfPagesError


class RemoteSteps:
    """Mixin of `scheduler.Scheduler` (not imported here: the scheduler imports this module): `transfers` (prefill
    role) and `puller` (decode role) are set by the scheduler (None otherwise)."""

    transfers: TransferStore | None
    puller: Puller | None

    def remote_work(self) -> bool:
        """Exports to release or pulls landed: the engine loop steps for them even with nothing else to do."""
        return bool(self.transfers and self.transfers.has_work() or self.puller and self.puller.has_work())

    def _remote_events(self) -> None:
        """Free the pages of taken or expired exports; import the pulls that landed."""
        if self.transfers is not None:
            for pages in self.transfers.releases():
                self._release(self.prefill_alloc, pages)
        if self.puller is not None:
            for seq, result, seconds in self.puller.landed():
                if seq.status is Status.PULLING:  # otherwise it ended meanwhile (abort) and its pages are back
                    self._land(seq, result, seconds)

    # ---- prefill role ---------------------------------------------------------------------------------------
    def _exports(self, seqs: list[Sequence]) -> None:
        """In place of the hand-off: emit each prefilled sequence's first token and end it, exporting its pages
        first when asked to."""
        for seq in seqs:
            token, logprob, top = seq.pending
            seq.pending = None
            if seq.req.export_kv:
                try:
                    self._export(seq, token, logprob)
                except KVTransferError as err:
                    self._fail(seq, err)
                    continue
            self._accept(seq, token, logprob, top)
            if seq.status is not Status.FINISHED:
                self._finish(seq, "length")  # a prefill server never decodes

    def _export(self, seq: Sequence, token: int, logprob: float) -> None:
        """Convert seq's prefill pages to the decode format on the device, checksum them, and hand them (and the
        request's reference to them) to the transfer store."""
        self.programs.sync_tags(self.prefill_alloc, self.decode_alloc)
        chunk, sums = self.programs.export_chunk([p for p, _ in seq.prefill_pages])
        tid = self.transfers.put(seq.prefill_pages, chunk, sums)
        seq.prefill_pages = []  # the store holds them until pulled or timed out
        host, port = self.transfers.address
        seq.kv_transfer = {"transfer_id": tid, "host": host, "port": port, "num_tokens": seq.target,
                           "first_token": token, "first_logprob": logprob, "page_size": self.cfg.page_size,
                           "kv_format": self.programs.layouts.decode.dtype, "prompt_token_ids": seq.req.prompt}

    def _transfer_of(self, seq: Sequence, reason: str) -> dict | None:
        """The kv_transfer_params seq's finish event carries: only when it ended by length after its first token
        (a stop leaves nothing to decode: its export is dropped)."""
        if seq.kv_transfer is None:
            return None
        if reason == "length":
            return seq.kv_transfer
        self.transfers.drop(seq.kv_transfer["transfer_id"])
        return None

    # ---- decode role ----------------------------------------------------------------------------------------
    def _admit_pull(self, seq: Sequence) -> bool:
        """Give the first waiting sequence decode pages for its prompt and start its pull. -> False if it waits."""
        rank = self.place.rank_for(seq.tokens)
        if rank is None:
            return False
        pages = self._allocate(self.decode_alloc, self.place.pages_for(len(seq.req.prompt)), evict=False, rank=rank)
        if pages is None:
            return False
        self.waiting.popleft()
        seq.rank = rank
        seq.target = len(seq.req.prompt)
        seq.decode_pages = pages  # returned by _finish if the request ends before its pages land
        seq.status = Status.PULLING
        self.stats.prompt_tokens += seq.target
        self.running.append(seq)
        self.puller.start(seq)
        return True

    def _land(self, seq: Sequence, result: Pulled | JaxserveError, seconds: float) -> None:
        """Import a landed pull into seq's pages and verify it, then decode; or fail seq with the pull's error."""
        if isinstance(result, JaxserveError):
            self._fail(seq, result)
            return
        pages = seq.decode_pages
        if result.num_pages != len(pages):
            self._fail(seq, KVTransferError(f"the transfer holds {result.num_pages} pages; this request's prompt "
                                            f"needs {len(pages)}", value=result.num_pages, param="kv_transfer_params"))
            return
        self.programs.sync_tags(self.prefill_alloc, self.decode_alloc)
        ids = [p for p, _ in pages]
        self.programs.import_chunk(chunk_of(result, self.programs), ids, result.src_tags, [t for _, t in pages])
        bad = np.flatnonzero(np.any(self.programs.decode_checksums(ids) != result.checksums, axis=1))
        if bad.size:
            self._fail(seq, KVTransferError(f"KV pages {bad.tolist()[:8]} of request {seq.req.request_id!r} differ "
                                            "from what the prefill server sent (checksum)", value=bad.tolist()[:8],
                                            param="kv_transfer_params"))
            return
        st = self.stats
        st.transfers, st.transfer_bytes, st.transfer_s = st.transfers + 1, st.transfer_bytes + result.payload_bytes, \
            st.transfer_s + seconds
        st.transfer_tokens += result.num_pages * self.cfg.page_size
        spec = seq.req.pull
        seq.pending = (spec.first_token, spec.first_logprob, ())
        self._guarded(seq, self._handed_off, seq, pages)

    def _preempt_remote(self, seq: Sequence) -> None:
        """Decode role: a preempted request cannot be recomputed here (no prefill): it fails, its pages return."""
        self._fail(seq, OutOfPagesError("the decode pool is full and this decode server cannot recompute a "
                                        "preempted request (no prefill here): retry it", value=seq.req.request_id,
                                        param="max_tokens"))
