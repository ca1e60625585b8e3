"""The library API: `Engine.from_checkpoint(path, EngineConfig(...))`, `generate`, streaming `submit`, `abort`,
`stats`. A background thread runs the scheduler loop; `start=False` gives a synchronous engine driven by `step()`
(tests, benchmarks).

Per-request host work stays off the loop thread: a request's grammar is compiled in `submit` (the caller's thread;
llguidance drops the GIL while it builds, engine.structured), and its text (detokenization, stop strings:
engine.text_stream) is made in its event iterator, on the consumer's thread. The loop only steps the scheduler."""
from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import jax.numpy as jnp

from jaxserve.checkpoint import load
from jaxserve.engine import heap
from jaxserve.engine.batch import compile_unpack
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.exit_hook import close_at_exit
from jaxserve.engine.fallback import CompiledShapes
from jaxserve.engine.kv_transfer import Puller, TransferStore
from jaxserve.engine.mtp_draft import serving_models, uses_mtp
from jaxserve.engine.priming import prime, run_once
from jaxserve.engine.programs import Programs, phase_devices, phase_parallel
from jaxserve.engine.request import Request, RequestOutput, SamplingParams, TokenEvent
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.structured import GrammarCompiler
from jaxserve.engine.text_stream import TextStream
from jaxserve.engine.warm_manifest import holds_plan, run_full
from jaxserve.engine.warmup import Key, MapGuard, WarmupLevel, WarmupReport, default_max_maps, plan_keys
from jaxserve.errors import InvalidRequestError, JaxserveError, QueueFullError
from jaxserve.models import CausalLM

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
IDLE_COMPILE_S = 1.0  # deferred compiles start after the loop has had no work for this long


class Engine:
    def __init__(self, model: CausalLM, cfg: EngineConfig, tokenizer: object | None = None, *,
                 start: bool = True, warmup: bool | Literal["first"] = False, decode_model: CausalLM | None = None
                 ) -> None:
        """warmup: True compiles the whole bucket grid (`Programs.warmup`), "first" what a first short greedy
        request runs, in parallel (`Programs.compile_first`), and its sampled programs later, in a background thread
        once the engine is idle (`compile_deferred`), False nothing (programs compile on first use)."""
        self.cfg = cfg
        model, decode_model = serving_models(model, decode_model, cfg)  # the MTP head only for mtp speculation
        self.model_cfg = model.cfg  # no reference to `model` is kept: each phase holds its own formatted weights
        self.tokenizer = tokenizer
        self.programs = Programs(model, cfg, decode_model)
        # compiles left for when the engine is idle (warmup="first": the sampled first-request programs), and the
        # thread that runs them once the loop has been idle for IDLE_COMPILE_S (join it to wait)
        self.deferred_compiles: list[Callable[[], None]] = []
        self.background_compile: threading.Thread | None = None
        # the memory-mapping bound between steps (engine.warmup.MapGuard); its evictions count the warm-up's too
        self.map_guard = MapGuard(cfg.max_maps if cfg.max_maps is not None else default_max_maps(),
                                  self.programs.resident)
        self._queues: dict[str, tuple[queue.Queue[TokenEvent], TextStream]] = {}  # in flight: events, text
        self._qlock = threading.Lock()
        eos = tuple(dict.fromkeys(tuple(model.cfg.eos_token_ids) + tuple(getattr(tokenizer, "eos_token_ids", ()))))
        self.grammar = GrammarCompiler(tokenizer, model.cfg.vocab_size, eos) if tokenizer is not None else None
        self._wake = threading.Event()
        # prefill role: the exports and the KV transfer service; decode role: the pulls (engine.kv_transfer)
        self.transfers = TransferStore(cfg, self._wake.set) if cfg.role == "prefill" else None
        puller = Puller(self.programs, self._wake.set) if cfg.role == "decode" else None
        self.scheduler = Scheduler(self.programs, model.cfg, cfg, self._emit, tokenizer, self.grammar,
                                   self.transfers, puller)
        if warmup == "first":
            self._warm_first()
        elif warmup:
            self.programs.warmup()
        self._step_lock = threading.Lock()  # the scheduler is single-threaded: one step at a time, any caller
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread: threading.Thread | None = None
        # closed at exit if the caller does not: its threads stop before JAX's exit handlers (engine.exit_hook)
        self._cancel_exit_close = close_at_exit(self.close)
        if start:
            self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
            self._thread.start()

    @classmethod
    def from_checkpoint(cls, path: str | Path, cfg: EngineConfig = EngineConfig(), *, start: bool = True,
                        warmup: bool | Literal["first"] = False) -> Engine:
        """Load a checkpoint (and its tokenizer, if the folder has one) straight onto each phase's mesh.

        Each phase restores only its own format: one stored by `jaxserve quantize` (fp8 / int4) is read as is;
        otherwise the checkpoint's own weights are read and quantized on the devices. Every array is restored
        directly into its sharding (no host or single-device staging). Phases on the same devices with the same
        format share one copy; with different formats (FP8 prefill + INT4 decode, not disaggregated) both are
        resident: `jaxserve plan` shows what that costs.
        """
        from jaxserve.checkpoint import load_formats
        from jaxserve.tokenizer import Tokenizer

        stored = load_formats(path)
        dtype = _DTYPES[cfg.dtype]
        p_dev, d_dev = phase_devices(cfg)
        loaded: dict[tuple, CausalLM] = {}

        def model_for(fmt: str, devices: list) -> CausalLM:
            key = fmt if fmt in stored and fmt in ("fp8", "int4") else None
            cache_key = (key, tuple(d.id for d in devices))
            if cache_key not in loaded:
                par = phase_parallel(cfg, devices)
                loaded[cache_key] = load(path, dtype=dtype, weights=key, mesh=par.mesh, rules=par.rules,
                                         mtp=uses_mtp(cfg))[1]  # an unused head is not read
            return loaded[cache_key]

        # each role loads only its own phase's weights
        prefill_model = model_for(cfg.prefill_weights, p_dev) if "prefill" in cfg.phases else None
        decode_model = model_for(cfg.decode_weights, d_dev) if "decode" in cfg.phases else None
        del loaded
        if uses_mtp(cfg):  # a checkpoint without an MTP head: the error names it
            serving_models(prefill_model, decode_model, cfg, name=str(path))
        has_tok = any((Path(path) / f).exists() for f in ("tokenizer.json", "tiktoken.model"))
        return cls(prefill_model or decode_model, cfg, Tokenizer(path) if has_tok else None, start=start,
                   warmup=warmup, decode_model=decode_model)

    # ---- requests ----------------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass token ids", value=prompt[:40],
                                          param="prompt")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def validate(self, req: Request) -> None:
        """Raise InvalidRequestError naming what is wrong; nothing is queued for a bad request."""
        V = self.model_cfg.vocab_size
        if not req.prompt:
            raise InvalidRequestError("the prompt is empty", value=req.prompt, param="prompt")
        bad = [t for t in req.prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {V})", value=bad[:5], param="prompt")
        if len(req.prompt) >= self.cfg.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(req.prompt)} tokens; the context window is "
                                      f"{self.cfg.max_model_len}", value=len(req.prompt), param="prompt")
        req.params.validate(V)
        self._check_role(req)
        ps = self.cfg.page_size
        need = -(-min(len(req.prompt) + req.params.max_tokens, self.cfg.max_model_len) // ps)
        pools = {"prefill": self.cfg.num_prefill_pages, "decode": self.cfg.num_decode_pages}
        capacity = min(pools[p] for p in self.cfg.phases) - 1  # page 0 is the null page
        if need > capacity:
            # it could never be admitted: refuse now rather than queue it forever
            raise InvalidRequestError(f"the request needs {need} KV pages of {ps} tokens; the pools hold {capacity}",
                                      value=need, param="max_tokens")

    def _check_role(self, req: Request) -> None:
        """A prefill server decodes nothing past the first token; a decode server prefills nothing (PD_PROTOCOL.md)."""
        role = self.cfg.role
        if role == "decode" and req.pull is None:
            raise InvalidRequestError("a decode server takes requests from a router: kv_transfer_params missing",
                                      value=None, param="kv_transfer_params")
        if role == "decode" and req.params.prompt_logprobs is not None:
            raise InvalidRequestError("a decode server has no prefill to score the prompt with: prompt logprobs "
                                      "(echo with logprobs) need a --role both server", value=req.params.prompt_logprobs,
                                      param="prompt_logprobs")
        if role != "decode" and req.pull is not None:
            raise InvalidRequestError(f"kv_transfer_params to pull from are for a decode server; this one runs "
                                      f"--role {role}", value=req.pull.transfer_id, param="kv_transfer_params")
        if role == "prefill" and not req.export_kv and req.params.max_tokens > 1:
            raise InvalidRequestError("a --role prefill server generates only the first token: send max_tokens 1, or "
                                      'kv_transfer_params {"do_remote_decode": true} through a router',
                                      value=req.params.max_tokens, param="max_tokens")
        if role != "prefill" and req.export_kv:
            raise InvalidRequestError(f"do_remote_decode needs a --role prefill server; this one runs --role {role}",
                                      value=True, param="kv_transfer_params")

    def _matcher(self, req: Request) -> object | None:
        """The request's grammar matcher (engine.structured), None without structured output."""
        so = req.params.structured
        if so is None:
            return None
        if self.grammar is None:
            raise InvalidRequestError("structured output needs the model's tokenizer", value=so.kind, param=so.param)
        return self.grammar.matcher(so)

    def _register(self, reqs: Sequence[Request], q: queue.Queue[TokenEvent]) -> dict[str, TextStream]:
        """Route reqs' events to q -> each one's text stream (its own decoder and stop strings)."""
        rids = [r.request_id for r in reqs]
        with self._qlock:
            if len(self._queues) + len(rids) > self.cfg.max_queue:
                raise QueueFullError(f"{len(self._queues)} requests in flight (max_queue {self.cfg.max_queue})",
                                     value=len(self._queues), param="max_queue")
            for rid in rids:
                if rid in self._queues or rids.count(rid) > 1:
                    raise InvalidRequestError("a request with this id is in flight", value=rid, param="request_id")
            texts = {r.request_id: TextStream(self._decoder(), r.params.stop) for r in reqs}
            for rid in rids:
                self._queues[rid] = (q, texts[rid])
        return texts

    def _decoder(self) -> object | None:
        """A fresh tokenizer.StreamDecoder, None without a tokenizer."""
        if self.tokenizer is None:
            return None
        from jaxserve.tokenizer import StreamDecoder

        return StreamDecoder(self.tokenizer)

    def _enqueue(self, req: Request, matcher: object | None) -> None:
        self.scheduler.submit(req, matcher)
        self._wake.set()

    def submit(self, req: Request) -> Iterator[TokenEvent]:
        """Queue a request; returns the iterator of its events (tokens, then one finish event)."""
        self.validate(req)
        matcher = self._matcher(req)
        q: queue.Queue[TokenEvent] = queue.Queue()
        texts = self._register([req], q)
        self._enqueue(req, matcher)
        return self._events(texts, q)

    def submit_group(self, reqs: Sequence[Request]) -> Iterator[tuple[int, TokenEvent]]:
        """Queue several requests for one prompt (OpenAI `n`): the first alone, the others once its prefill is done
        (its first event), so they find its prompt pages in the prefix cache and compute only the last partial
        page. Returns one iterator of (index in reqs, event), in arrival order, until every request has finished;
        closing it early aborts the unfinished ones."""
        for r in reqs:
            self.validate(r)
        matchers = [self._matcher(r) for r in reqs]
        q: queue.Queue[TokenEvent] = queue.Queue()
        texts = self._register(reqs, q)
        self._enqueue(reqs[0], matchers[0])
        return self._group_events(reqs, matchers, texts, q)

    def _group_events(self, reqs: Sequence[Request], matchers: list[object | None], texts: dict[str, TextStream],
                      q: queue.Queue[TokenEvent]) -> Iterator[tuple[int, TokenEvent]]:
        index = {r.request_id: i for i, r in enumerate(reqs)}
        waiting = list(zip(reqs[1:], matchers[1:]))
        with contextlib.closing(self._events(texts, q)) as events:  # closing this closes (aborts) them at once
            for ev in events:
                if waiting:
                    for r, m in waiting:
                        self._enqueue(r, m)
                    waiting = []
                yield index[ev.request_id], ev

    def _events(self, texts: dict[str, TextStream], q: queue.Queue[TokenEvent]) -> Iterator[TokenEvent]:
        """The consumer's side of the requests in `texts` (sharing q): their events in arrival order, with their
        text, until every one has finished; closing it early aborts the unfinished ones (a client disconnect: their
        pages return)."""
        left = set(texts)
        try:
            while left:
                if self._thread is None:
                    while q.empty():
                        self.step()
                ev = q.get()
                if self._thread is not None:  # the text is made here, on the consumer's thread
                    ev = self._consume(ev, texts[ev.request_id])
                    if ev is None:
                        continue
                if ev.finish_reason is not None:
                    left.discard(ev.request_id)
                yield ev
        finally:
            with self._qlock:
                unfinished = [rid for rid in texts if rid in self._queues]
                for rid in unfinished:
                    self._queues.pop(rid, None)
            for rid in unfinished:
                self.abort(rid)

    def _consume(self, ev: TokenEvent, text: TextStream) -> TokenEvent | None:
        """An event from the engine -> the consumer's (None: dropped, a token after a stop string). A stop string
        ends the request in the engine; its finish event (the engine's acknowledgement) then ends the stream."""
        if ev.finish_reason is not None:
            if text.stopped and ev.kv_transfer is not None and self.transfers is not None:
                self.transfers.drop(ev.kv_transfer["transfer_id"])  # exported before the stop string was seen
                self._wake.set()
            return text.finish(ev)
        if text.stopped:
            return None
        ev = text.token(ev)
        if text.stopped:
            self.abort(ev.request_id, "stop")
        return ev

    def _emit(self, ev: TokenEvent) -> bool:
        """The scheduler's output (engine thread, or a synchronous engine's `step` caller) -> True to end the
        request now with "stop" (synchronous engine only: its text is made here, as the step's caller consumes)."""
        with self._qlock:
            entry = self._queues.get(ev.request_id)
            if ev.finish_reason is not None:
                self._queues.pop(ev.request_id, None)
        if entry is None:
            return False
        q, text = entry
        if self._thread is None:
            ev = text.finish(ev) if ev.finish_reason is not None else text.token(ev)
            q.put(ev)
            return text.stopped
        q.put(ev)
        return False

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request (reason "stop": a stop string the consumer found; Scheduler.abort)."""
        self.scheduler.abort(request_id, reason)
        self._wake.set()

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 = SamplingParams()) -> list[RequestOutput]:
        """Run prompts concurrently to completion; results in prompt order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [Request(self.encode(p), sp) for p, sp in zip(prompts, plist, strict=True)]
        streams = [self.submit(r) for r in reqs]
        outs = []
        for req, stream in zip(reqs, streams):
            ids, lps, text = [], [], []
            end: TokenEvent | None = None
            scores = None
            for ev in stream:
                scores = ev.prompt_logprobs or scores
                if ev.token_id is not None:
                    ids.append(ev.token_id)
                    lps.append(ev.logprob)
                    text.append(ev.text)
                if ev.finish_reason is not None:
                    end = ev
            outs.append(RequestOutput(req.request_id, len(req.prompt), ids, lps, "".join(text), end.finish_reason,
                                      end.cached_tokens, end.error, scores))
        return outs

    # ---- the loop ----------------------------------------------------------------------------------------
    def step(self) -> None:
        """One scheduler iteration. A failure inside fails the in-flight requests (with their pages freed), not
        the engine."""
        try:
            with self._step_lock:
                self.scheduler.step()
                if self.background_compile is None or not self.background_compile.is_alive():
                    self.map_guard.check()  # nothing else of this engine is loading a program now
        except Exception as e:  # noqa: BLE001 - any failure must end requests cleanly, never hang them
            err = e if isinstance(e, JaxserveError) else JaxserveError(f"engine step failed: {e!r}")
            for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler._finish(seq, "error", err)

    def warm_up(self, level: WarmupLevel, progress: bool = False, max_maps: int | None = None,
                hold: threading.Event | None = None) -> WarmupReport:
        """Compile ahead of traffic what `level` promises (engine.warmup: "full" every program a plain request
        can select, or, when `warm_manifest` vouches the compile cache holds them all, the fast set now and the rest
        loaded from the cache after ready as "fast" does; "fast" the largest shape of each kind, then the rest in one
        background thread while steps pad to what is compiled, `engine.fallback`; "none" nothing); then runs the
        fast set (full: the same set) once on padding under the step lock (`engine.priming`: no request pays a
        program's first run); safe beside live traffic (padding writes no page). Returns what it compiled before
        returning and what the persistent cache answered. max_maps: the memory mappings the compiles may hold before
        they drop compiled programs to the persistent cache (default `EngineConfig.max_maps`; `warmup.run_jobs`).
        hold: "fast"'s background thread waits for it (tests)."""
        max_maps = self.map_guard.max_maps if max_maps is None else max_maps
        self.map_guard.warming += 1  # the warm-up keeps the bound itself; no step evicts under its loads
        try:
            if level == "none":
                return WarmupReport(level)
            shapes = CompiledShapes(self.programs)
            if level == "full" and not holds_plan(self.programs):  # cold: all of it now, then its manifest
                report = run_full(self.programs, progress, max_maps)
                self.map_guard.evictions += report.evictions
                # what the mapping bound dropped meanwhile loads again in the background when a step wants it, the
                # step padded meanwhile: a load on the engine thread would stall every stream
                rest: list[Key] = []
                fast = set(shapes.adopt(plan_keys(self.programs)))  # what fast holds runs once, not the whole plan
            else:
                rest = shapes.warm(level, progress, max_maps)  # warm "full": the cache holds the rest (warm_manifest)
                report = shapes.report
                report.skipped = len(rest) if level == "full" else 0
                fast = set(shapes.done)
            self._prime(fast, report)
            shapes.runner = self._run_once  # the background's programs too, before a step may use them
            self.scheduler.shapes = shapes  # from the next step on, a shape not compiled yet pads to a compiled one
            report.freeze_seconds = heap.freeze()  # before the background adds to it (it freezes after each job)
            self.map_guard.warming += 1  # the background thread's own run_jobs keeps the bound until it is done
            shapes.start(rest, hold, max_maps, done=self._background_done)
            return report
        finally:
            self.map_guard.warming -= 1

    def _prime(self, keys: set[Key] | list[Key], report: WarmupReport) -> None:
        """Run the programs of `keys` once on padding (`engine.priming`) so no live request pays a first run."""
        prime(self.programs, keys, self.scheduler.ranks, self._step_lock, report)

    def _run_once(self, key: Key) -> None:
        """Run one plan key's program once on padding, between steps (`engine.priming`)."""
        with self._step_lock:
            run_once(self.programs, key, self.scheduler.ranks)

    def _background_done(self, report: WarmupReport | None) -> None:
        """The fast warm-up's background compiles ended (report None: they stopped on an error)."""
        if report is not None:
            self.map_guard.evictions += report.evictions
        self.map_guard.warming -= 1

    def _warm_first(self) -> None:
        """warmup="first": what a first short greedy request runs (`Programs.compile_first`), in parallel, its
        sampled programs deferred to the first idle second (`compile_deferred`); others compile on first use."""
        extra = [functools.partial(compile_unpack, self.programs.decode_rows, self.cfg.row_buckets[0],
                                   self.cfg.page_buckets[0])] if "decode" in self.cfg.phases else []
        self.programs.compile_first(extra=extra)
        self.deferred_compiles.append(self.programs.compile_first_sampled)

    def compile_deferred(self) -> None:
        """Run the deferred compiles now, in this thread (the loop starts them itself when idle)."""
        while True:
            try:
                compile_one = self.deferred_compiles.pop(0)  # atomic: the loop's thread may be popping too
            except IndexError:
                return
            compile_one()

    def _loop(self) -> None:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            if self.scheduler.has_work():
                self.step()
                idle_since = time.monotonic()
            else:
                if self.deferred_compiles and self.background_compile is None and \
                        time.monotonic() - idle_since >= IDLE_COMPILE_S:
                    # idle, not at start-up's first request: tracing and compiling would slow it down
                    thread = threading.Thread(target=self.compile_deferred, daemon=True,
                                              name="jaxserve-compile-deferred")
                    thread.start()
                    self.background_compile = thread  # published only once started: callers may join it at once
                self._wake.wait(0.05)
                self._wake.clear()

    def close(self) -> None:
        """Stop the loop, the background compiles and the KV transfer service, waiting for the work in flight (a
        second call does nothing new)."""
        self._cancel_exit_close()
        if self.transfers is not None:
            self.transfers.close()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.scheduler.shapes is not None:  # the fast warm-up's background compiles end with the engine
            self.scheduler.shapes.stop(timeout=60)
        self.deferred_compiles.clear()  # warmup="first"'s idle compiles: the one in flight ends, no more start
        if self.background_compile is not None:
            self.background_compile.join(timeout=60)
        self.map_guard.close()
        heap.thaw()  # what the warm-up froze (this engine's programs and caches) may be collected

    def pool_status(self) -> dict[str, int]:
        """This role's page pool (decode's, prefill's for a prefill server): free pages (prefix-cache pages only the
        cache holds count as free: they are evicted on demand), total allocatable pages, page size."""
        s = self.scheduler
        alloc = s.prefill_alloc if self.cfg.role == "prefill" else s.decode_alloc
        evictable = sum(1 for c in s.prefix_caches for e in list(c.entries.values())
                        if alloc is s.prefill_alloc and alloc.refcount(e.page) == 1 and alloc.tag(e.page) == e.tag)
        return {"free_pages": alloc.num_free + evictable, "total_pages": alloc.capacity, "page_size": self.cfg.page_size}

    def prefix_match(self, tokens: Sequence[int], cache_salt: str | None = None) -> int:
        """Prompt tokens the prefix cache would serve for `tokens` (no references taken, LRU order untouched)."""
        cache = self.scheduler.prefix_cache
        return 0 if cache is None else cache.match(list(tokens), cache_salt) * self.cfg.page_size

    def stats(self) -> dict[str, float]:
        s = self.scheduler
        st = s.stats
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return {
            "decode_pages_used": s.decode_alloc.num_used, "decode_pages_free": s.decode_alloc.num_free,
            "prefill_pages_used": s.prefill_alloc.num_used, "prefill_pages_free": s.prefill_alloc.num_free,
            "prefix_cache_pages": sum(len(c) for c in s.prefix_caches),
            "waiting": len(s.waiting) + s.pending(), "running": len(s.running),
            "tag_mismatches": st.tag_mismatches, "preemptions": st.preemptions,
            "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens,
            "generated_tokens": st.generated_tokens, "finished": st.finished, "aborted": st.aborted,
            "tokens_per_s": st.generated_tokens / elapsed, "steps": st.steps,
            "kv_transfers": st.transfers, "kv_transfer_bytes": st.transfer_bytes,
            "kv_transfer_tokens": st.transfer_tokens, "kv_transfer_s": st.transfer_s,
            "verify_rows": st.verify_rows, "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
            "evictions": self.map_guard.evictions, **self._fallback_stats(),
        }

    def _fallback_stats(self) -> dict[str, int]:
        """`--warmup fast`'s padded fallback: steps padded into a larger loaded shape, evicted programs loaded again,
        plan programs not loaded now (all 0 without it)."""
        shapes = self.scheduler.shapes
        if shapes is None:
            return {"padded_steps": 0, "program_reloads": 0, "programs_pending": 0}
        return {"padded_steps": shapes.padded, "program_reloads": shapes.reloads, "programs_pending": shapes.pending()}
