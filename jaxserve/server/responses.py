"""The OpenAI response shapes of one generation request: choices, usage, logprobs, errors, and the two answers.

`complete` gathers a request's token events into one JSON body; `stream` turns them into Server-Sent Events
(`data: <chunk JSON>` per event, ending in `data: [DONE]`), an engine failure mid-stream travelling in-band as
`data: <error JSON>`. Every error body is OpenAI's `{"error": {"message", "type", "param", "code"}}`, its status
from `jaxserve.errors.http_status` (the one place that maps exception types to codes).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from jaxserve.engine import TokenEvent
from jaxserve.engine.request import PromptLogprobs
from jaxserve.errors import JaxserveError, QueueFullError, RequestAbortedError, ShuttingDownError, http_status
from jaxserve.server.limits import RETRY_AFTER_S, DisconnectWatcher
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.protocol import Generation
from jaxserve.server.reasoning import ReasoningParser
from jaxserve.server.toolcalls import ToolCall, ToolCallParser

DONE = "data: [DONE]\n\n"
log = logging.getLogger("jaxserve.server")


@dataclass(frozen=True)
class Shape:
    """How one endpoint shapes its answer (completion text vs chat message)."""

    endpoint: str
    id_prefix: str
    object_name: str
    chunk_object: str
    chat: bool


COMPLETION = Shape("/v1/completions", "cmpl", "text_completion", "text_completion", chat=False)
CHAT = Shape("/v1/chat/completions", "chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


def error_body(err: JaxserveError) -> dict[str, Any]:
    """The OpenAI error object for a typed error."""
    return {"error": {"message": err.message, "type": err.error_type, "param": err.param,
                      "code": getattr(err, "code", None)}}


def error_response(err: JaxserveError, retry_after_s: int = RETRY_AFTER_S) -> Response:
    """A typed error as a JSON response with its HTTP status (429 also says when to retry)."""
    resp = Response(json.dumps(error_body(err)), status=http_status(err), mimetype="application/json")
    if isinstance(err, (QueueFullError, ShuttingDownError)):
        resp.headers["Retry-After"] = str(retry_after_s)
    return resp


def http_error_response(err: HTTPException) -> Response:
    """Flask's own errors (unknown route or method, ...) in OpenAI's shape: an invalid_request_error with a code
    clients can test."""
    message = f"Invalid URL ({request.method} {request.path[:200]})" if err.code == 404 else err.description
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.code or 500)
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    return Response(json.dumps(body), status=err.code or 500, mimetype="application/json")


def add_error_handlers(app: Flask, count: Callable[[str, int], None], retry_after_s: int = RETRY_AFTER_S) -> None:
    """Every error of `app` as an OpenAI-shaped JSON body; every response counted by `count(route, status)`."""

    @app.errorhandler(JaxserveError)
    def typed_error(err: JaxserveError) -> Response:
        return error_response(err, retry_after_s)

    app.register_error_handler(HTTPException, http_error_response)

    @app.errorhandler(Exception)
    def unexpected(err: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(JaxserveError(f"internal error: {type(err).__name__}"))

    @app.after_request
    def counted(resp: Response) -> Response:
        count(request.url_rule.rule if request.url_rule else "other", resp.status_code)
        return resp


def usage(ends: list[TokenEvent], n: int = 1) -> dict[str, Any]:
    """Usage of a request's choices (n per prompt, in prompt order): each prompt counts once (its first choice's),
    completions add up."""
    firsts = ends[::n]
    prompt = sum(e.prompt_tokens for e in firsts)
    completion = sum(e.completion_tokens for e in ends)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(e.cached_tokens for e in firsts)}}


@dataclass
class Choice:
    """One choice's answer as it accumulates. parser: the tool-call parser of a chat with tools; thinking: the
    reasoning parser of a thinking model's chat (each None otherwise)."""

    parser: ToolCallParser | None = None
    thinking: ReasoningParser | None = None
    text: list[str] = field(default_factory=list)
    lps: list[dict[str, Any]] = field(default_factory=list)
    offset: int = 0
    end: TokenEvent | None = None

    def read(self, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        """New output text -> (reasoning, content, tool-call deltas) ready to send."""
        reasoning, rest = self.thinking.push(text) if self.thinking is not None else ("", text)
        if self.parser is None:
            return reasoning, rest, []
        content, calls = self.parser.push(rest)
        return reasoning, content, calls

    def read_end(self, truncated: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """End of output -> what the parsers held back. Raises ToolCallParseError for invalid markup."""
        reasoning, rest = self.thinking.finish() if self.thinking is not None else ("", "")
        if self.parser is None:
            return reasoning, rest, []
        content, calls = self.parser.push(rest)
        more, last = self.parser.finish(truncated)
        return reasoning, content + more, calls + last


def split_output(c: Choice, out: str, truncated: bool) -> tuple[str, str, list[ToolCall]]:
    """A whole output -> (reasoning, content, tool calls); content is "" when only whitespace surrounds calls."""
    r1, c1, _ = c.read(out)
    r2, c2, _ = c.read_end(truncated)
    calls = list(c.parser.calls) if c.parser is not None else []
    content = c1 + c2
    return r1 + r2, "" if calls and not content.strip() else content, calls


def single_choice(events: Iterator[TokenEvent]) -> Iterator[tuple[int, TokenEvent]]:
    """One request's events as choice 0's."""
    try:
        for ev in events:
            yield 0, ev
    finally:
        events.close()


def sse(obj: Any) -> str:
    """One Server-Sent Event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def end_error(end: TokenEvent, aborted_why: str = "the engine aborted this request") -> JaxserveError | None:
    """The error a finished request should report, if it did not end normally."""
    if end.finish_reason == "error":
        return end.error or JaxserveError("the engine failed this request")
    if end.finish_reason == "abort":
        return RequestAbortedError(aborted_why)
    return None


class TokenText:
    """How a token id reads in logprobs: its text, and its bytes under a byte-level tokenizer (None: no tokenizer,
    token ids only)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def text(self, tid: int) -> str:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else ""

    def bytes(self, tid: int) -> list[int] | None:
        if self.tokenizer is None or not self.tokenizer.byte_level:
            return None
        return list(self.tokenizer.token_bytes(tid))


def completion_logprobs(entries: list[dict[str, Any]], top: bool) -> dict[str, Any]:
    """A completion choice's per-token logprob entries joined into OpenAI's column form."""
    return {"tokens": [e["tokens"][0] for e in entries], "token_logprobs": [e["token_logprobs"][0] for e in entries],
            "top_logprobs": [e["top_logprobs"][0] for e in entries] if top else None,
            "text_offset": [e["text_offset"][0] for e in entries]}


@dataclass(frozen=True)
class Reply:
    """What shaping one generation request's answer needs: the validated request, its endpoint's shape, the
    response id, the served model's name, how tokens read, and the metrics its tokens and end are counted in."""

    gen: Generation
    shape: Shape
    rid: str
    model_name: str
    tokens: TokenText
    metrics: ServerMetrics
    aborted_why: Callable[[], str] = lambda: "the engine aborted this request"  # why an abort happened

    def choices(self) -> list[Choice]:
        """n fresh choices per prompt; an echoed prompt's text starts its choices' text."""
        echo = self.gen.echo or ("",) * len(self.gen.prompts)
        return [Choice(self.gen.tool_parser(), self.gen.reasoning_parser(), [e] if e else [], offset=len(e))
                for e in echo for _ in range(self.gen.n)]

    def prompt_entries(self, i: int, scores: PromptLogprobs) -> list[dict[str, Any]]:
        """Choice i's echoed prompt tokens in a completion's one-token column form (the first token's logprob and
        top alternatives are null, as OpenAI's)."""
        tokens, offset, out = self.tokens, 0, []
        for tid, lp, top in zip(self.gen.prompts[i // self.gen.n], scores.logprobs, scores.top):
            text = tokens.text(tid)
            alts = {tokens.text(t): v for t, v in top} if top else None
            out.append({"tokens": [text], "token_logprobs": [lp], "top_logprobs": [alts], "text_offset": [offset]})
            offset += len(text)
        return out

    def logprob_entry(self, ev: TokenEvent, offset: int) -> dict[str, Any]:
        """One sampled token's logprobs: chat's entry, or a completion's one-token column form."""
        tokens = self.tokens
        if self.shape.chat:
            return {"token": tokens.text(ev.token_id), "logprob": ev.logprob, "bytes": tokens.bytes(ev.token_id),
                    "top_logprobs": [{"token": tokens.text(t), "logprob": lp, "bytes": tokens.bytes(t)}
                                     for t, lp in ev.top_logprobs]}
        top = {tokens.text(t): lp for t, lp in ev.top_logprobs} if ev.top_logprobs else None
        return {"tokens": [tokens.text(ev.token_id)], "token_logprobs": [ev.logprob], "top_logprobs": [top],
                "text_offset": [offset]}

    def chunk(self, stamp: int, i: int, delta: dict[str, Any] | str, finish: str | None, lp: Any = None) -> str:
        """The SSE chunk of choice i: a chat delta or a completion's text."""
        c: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": finish}
        if self.shape.chat:
            c["delta"] = delta
        else:
            c["text"] = delta
        obj: dict[str, Any] = {"id": self.rid, "object": self.shape.chunk_object, "created": stamp,
                               "model": self.model_name, "choices": [c], "system_fingerprint": None}
        if self.gen.include_usage:
            obj["usage"] = None  # OpenAI: null on every chunk but the last
        return sse(obj)


# ---- the whole answer ------------------------------------------------------------------------------------------
def complete(reply: Reply, events: Iterator[tuple[int, TokenEvent]], t0: float, watcher: DisconnectWatcher,
             disconnected: Callable[[], bool] | None, abort: Callable[[str], None]) -> Response:
    """The JSON answer once every choice ended. While it runs, `watcher` polls `disconnected` (None: the server
    cannot tell) and calls `abort` if the client went away: that answer is a 499 nobody reads."""
    timer = reply.metrics.timer(t0)
    choices = reply.choices()
    if disconnected is not None:
        # counted before the abort: whoever sees the engine idle then also sees the count
        watcher.watch(reply.rid, disconnected,
                      lambda rid: (reply.metrics.disconnect(reply.shape.endpoint), abort(rid)))
    try:
        for i, ev in events:
            c = choices[i]
            if ev.prompt_logprobs is not None and reply.gen.logprobs:  # echo: the prompt's entries come first
                c.lps[:0] = reply.prompt_entries(i, ev.prompt_logprobs)
            if ev.token_id is not None:
                timer.token()
                if reply.gen.logprobs:
                    c.lps.append(reply.logprob_entry(ev, c.offset))
                c.text.append(ev.text)
                c.offset += len(ev.text)
            else:
                c.end = ev
    finally:
        gone = watcher.unwatch(reply.rid)
        events.close()  # the iterator aborts the requests that did not finish (never leak pages)
    ends = [c.end for c in choices]
    assert all(e is not None for e in ends)  # the engine always ends a stream with one finish event
    for e in ends:
        reply.metrics.finished(reply.shape.endpoint, e)
    if gone and any(e.finish_reason == "abort" for e in ends):
        return Response(status=499)  # nginx's "client closed request": nobody reads it; /metrics does
    for e in ends:
        err = end_error(e, reply.aborted_why())
        if err is not None:
            return error_response(err)
    out_choices = [_choice_json(reply, i, c) for i, c in enumerate(choices)]
    body = {"id": reply.rid, "object": reply.shape.object_name, "created": int(time.time()),
            "model": reply.model_name, "choices": out_choices, "usage": usage(ends, reply.gen.n),
            "system_fingerprint": None}
    if ends[0].kv_transfer is not None:  # a prefill server's answer: where a decode server pulls its KV pages
        body["kv_transfer_params"] = ends[0].kv_transfer
    return Response(json.dumps(body), mimetype="application/json")


def _choice_json(reply: Reply, i: int, c: Choice) -> dict[str, Any]:
    """One ended choice of the whole answer: a chat message (tool calls parsed out) or a completion's text."""
    out = "".join(c.text)
    if not reply.shape.chat:
        lp = completion_logprobs(c.lps, reply.gen.params.top_logprobs > 0) if reply.gen.logprobs else None
        return {"index": i, "text": out, "logprobs": lp, "finish_reason": c.end.finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": out}
    finish = c.end.finish_reason
    if c.parser is not None or c.thinking is not None:
        # invalid markup raises ToolCallParseError (500, reported, never text); an output cut at the
        # token limit keeps "length", its complete calls and the unfinished one as far as it was written
        reasoning, content, calls = split_output(c, out, truncated=finish == "length")
        message["content"] = content or None if calls else content
        if c.thinking is not None:
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
            finish = "tool_calls" if finish == "stop" else finish
    lp = {"content": c.lps} if reply.gen.logprobs else None
    return {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}


def chat_delta(reasoning: str, text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed chat delta: `content` (also when empty, unless the chunk carries only reasoning),
    `reasoning_content`, `tool_calls`."""
    delta: dict[str, Any] = {"content": text} if text or not reasoning else {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if calls:
        delta["tool_calls"] = calls
    return delta


# ---- the streamed answer ---------------------------------------------------------------------------------------
def stream(reply: Reply, events: Iterator[tuple[int, TokenEvent]], t0: float,
           ended: threading.Event, hung_up: Callable[[], None]) -> Iterator[str]:
    """The answer as SSE text, one chunk per token event; `ended` is set once the last chunk with content is out.
    `hung_up` counts the disconnect (once, shared with the watcher) when the server closes the stream before it."""
    timer = reply.metrics.timer(t0)
    stamp = int(time.time())
    choices = reply.choices()
    finished = False
    try:
        if reply.shape.chat:
            for i in range(len(choices)):
                yield reply.chunk(stamp, i, {"role": "assistant", "content": ""}, None)
        for i, ev in events:
            c = choices[i]
            if ev.token_id is not None:
                timer.token()
                yield from _token_chunks(reply, stamp, i, c, ev)
                continue
            c.end = ev
            reply.metrics.finished(reply.shape.endpoint, ev)
            err = end_error(ev, reply.aborted_why())
            if err is not None:
                finished = True
                ended.set()
                yield sse(error_body(err))  # the status line is long gone: the error travels in-band
                break
            yield from _finish_chunks(reply, stamp, i, c)
            if all(x.end is not None for x in choices):
                finished = True
                ended.set()
                if reply.gen.include_usage:
                    yield sse({"id": reply.rid, "object": reply.shape.chunk_object, "created": stamp,
                               "model": reply.model_name, "choices": [],
                               "usage": usage([x.end for x in choices], reply.gen.n),
                               "system_fingerprint": None})
        yield DONE
    except JaxserveError as err:
        finished = True
        ended.set()
        yield sse(error_body(err))
        yield DONE
    except GeneratorExit:
        if not finished:
            hung_up()  # waitress closes the iterator when the client went away
        raise
    finally:
        events.close()  # aborts the engine requests and frees their pages if they are still running


def _token_chunks(reply: Reply, stamp: int, i: int, c: Choice, ev: TokenEvent) -> Iterator[str]:
    """The chunk (if any) of one sampled token of choice i: its text, tool-call deltas, logprobs."""
    lp = None
    if reply.gen.logprobs:
        lp = reply.logprob_entry(ev, c.offset)
        lp = {"content": [lp]} if reply.shape.chat else lp
    c.offset += len(ev.text)
    if c.parser is not None or c.thinking is not None:
        reasoning, text, calls = c.read(ev.text)
        if reasoning or text or calls or lp is not None:
            yield reply.chunk(stamp, i, chat_delta(reasoning, text, calls), None, lp)
    elif ev.text or lp is not None:
        yield reply.chunk(stamp, i, {"content": ev.text} if reply.shape.chat else ev.text, None, lp)


def _finish_chunks(reply: Reply, stamp: int, i: int, c: Choice) -> Iterator[str]:
    """The last chunks of choice i, which ended normally: the parser's held-back text and calls, the finish."""
    finish = c.end.finish_reason
    if c.parser is not None or c.thinking is not None:
        # raises ToolCallParseError: reported in-band by `stream`; cut at max_tokens: the unfinished call comes
        # as far as it was written and the finish reason stays "length"
        reasoning, text, calls = c.read_end(truncated=finish == "length")
        if reasoning or text or calls:
            yield reply.chunk(stamp, i, chat_delta(reasoning, text, calls), None)
        if c.parser is not None and c.parser.calls and finish == "stop":
            finish = "tool_calls"
    yield reply.chunk(stamp, i, {} if reply.shape.chat else "", finish)
