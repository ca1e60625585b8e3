"""The Responses API's output: a response object and its typed stream events, built from the chat path's answer.

`OutputBuilder` turns a chat message's parts, as they come (reasoning text, content text, whole tool calls, the
finish), into output items (`reasoning` with one `reasoning_text` part, `message` with one `output_text` part,
`function_call`) and the events OpenAI streams for them, each with `type` and `sequence_number`:
response.created, response.in_progress, then per item response.output_item.added, response.content_part.added,
response.reasoning_text.delta / response.output_text.delta (or response.function_call_arguments.delta/done),
the .done events, response.output_item.done, and last response.completed (response.incomplete when
max_output_tokens cut the output; an error is an `error` event then response.failed). `whole_response` feeds it a
whole chat completion; `stream_events` feeds it the chat stream's SSE chunks and writes the events as SSE.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

MESSAGE_TYPES = ("message", "function_call")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_event(event: dict[str, Any]) -> str:
    """One typed Server-Sent Event (the `event:` line names its type, as OpenAI's)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class OutputBuilder:
    """One response's output items and events. echo: the request fields the response object carries back;
    count_tokens: text -> its token count (reasoning_tokens is the reasoning text re-encoded)."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any],
                 count_tokens: Callable[[str], int]) -> None:
        self.id = response_id
        self.model = model
        self.echo = echo
        self.count_tokens = count_tokens
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the reasoning item or message receiving text
        self._text: list[str] = []
        self._reasoning: list[str] = []

    def response(self, status: str, usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
                 incomplete: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object as it stands."""
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": [dict(item) for item in self.output], "usage": usage, "error": error,
                "incomplete_details": incomplete, **self.echo}

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        return self._append("reasoning", text)

    def text(self, text: str) -> list[dict[str, Any]]:
        return self._append("message", text)

    def calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Whole chat tool calls ({"id", "function": {"name", "arguments"}}) -> function_call items."""
        events = self._close("completed")
        for call in calls:
            fn = call["function"]
            item = {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": fn["name"],
                    "arguments": "", "status": "in_progress"}
            self.output.append(item)
            at = {"item_id": item["id"], "output_index": len(self.output) - 1}
            events.append(self._event("response.output_item.added", output_index=at["output_index"], item=dict(item)))
            events.append(self._event("response.function_call_arguments.delta", **at, delta=fn["arguments"]))
            events.append(self._event("response.function_call_arguments.done", **at, name=fn["name"],
                                      arguments=fn["arguments"]))
            item.update(arguments=fn["arguments"], status="completed")
            events.append(self._event("response.output_item.done", output_index=at["output_index"], item=dict(item)))
        return events

    def finish(self, finish_reason: str, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The output ended: close the open item (an empty message when nothing else was written), then
        response.completed, or response.incomplete when the token limit cut it."""
        cut = finish_reason == "length"
        events = self._close("incomplete" if cut else "completed")
        if not any(item["type"] in MESSAGE_TYPES for item in self.output):
            events += self._open_item("message") + self._close("incomplete" if cut else "completed")
        body = self.response("incomplete" if cut else "completed", self._usage(usage),
                             incomplete={"reason": "max_output_tokens"} if cut else None)
        events.append(self._event("response.incomplete" if cut else "response.completed", response=body))
        return events

    def fail(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An error mid-output (the chat error object): an `error` event, then response.failed."""
        events = self._close("incomplete")
        code = error.get("code") or error.get("type")
        events.append(self._event("error", code=code, message=error.get("message", ""), param=error.get("param")))
        failed = self.response("failed", error={"code": code, "message": error.get("message", "")})
        events.append(self._event("response.failed", response=failed))
        return events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _append(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = self._close("completed") if self._open is not None and self._open["type"] != kind else []
        if self._open is None:
            events += self._open_item(kind)
        self._text.append(text)
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(delta, item_id=self._open["id"], output_index=len(self.output) - 1,
                                  content_index=0, delta=text, **extra))
        return events

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": [], "status": "in_progress"}
        self.output.append(item)
        self._open, self._text = item, []
        i = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=i, item=dict(item)),
                self._event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                            part=_part(kind, ""))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        text = "".join(self._text)
        at = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if item["type"] == "reasoning":
            self._reasoning.append(text)
            done = self._event("response.reasoning_text.done", **at, text=text)
        else:
            done = self._event("response.output_text.done", **at, text=text, logprobs=[])
        part = _part(item["type"], text)
        item.update(content=[part], status=status)
        return [done, self._event("response.content_part.done", **at, part=part),
                self._event("response.output_item.done", output_index=at["output_index"], item=dict(item))]

    def _usage(self, usage: dict[str, Any] | None) -> dict[str, Any] | None:
        """Chat usage -> the Responses names."""
        if usage is None:
            return None
        reasoning = min(self.count_tokens("".join(self._reasoning)), usage["completion_tokens"])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": usage["total_tokens"]}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _read_delta(builder: OutputBuilder, delta: dict[str, Any]) -> list[dict[str, Any]]:
    """One chat message (or streamed delta) -> the events of its parts, in the order the model wrote them."""
    events = []
    if delta.get("reasoning_content"):
        events += builder.reasoning(delta["reasoning_content"])
    if delta.get("content"):
        events += builder.text(delta["content"])
    if delta.get("tool_calls"):
        events += builder.calls(delta["tool_calls"])
    return events


def whole_response(builder: OutputBuilder, chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion (one choice) -> the response object."""
    choice = chat["choices"][0]
    builder.start()
    _read_delta(builder, choice["message"])
    return builder.finish(choice["finish_reason"], chat["usage"])[-1]["response"]


def stream_events(builder: OutputBuilder, chunks: Iterable[str],
                  keep: Callable[[dict[str, Any]], None]) -> Iterator[str]:
    """The chat stream's SSE chunks (usage included) -> the Responses events as SSE; `keep` gets the final
    response object of an output that ended. Closing this closes the chat stream (which aborts the request)."""
    finish, usage = None, None
    try:
        yield from map(sse_event, builder.start())
        for chunk in chunks:
            data = chunk.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                yield from map(sse_event, builder.fail(obj["error"]))
                return
            usage = obj.get("usage") or usage
            for choice in obj.get("choices") or []:
                yield from map(sse_event, _read_delta(builder, choice.get("delta") or {}))
                finish = choice.get("finish_reason") or finish
        if finish is not None:
            events = builder.finish(finish, usage)
            keep(events[-1]["response"])
            yield from map(sse_event, events)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
