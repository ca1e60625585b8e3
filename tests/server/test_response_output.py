"""The Responses stream built from chat SSE chunks: an error chunk mid-output becomes an `error` event and
response.failed (nothing stored); the chat stream is closed however the Responses stream ends."""
from __future__ import annotations

import json
from collections.abc import Iterator

from jaxserve.server.response_output import OutputBuilder, stream_events


def chat_chunks(closed: list[bool]) -> Iterator[str]:
    try:
        yield 'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
        yield 'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
        yield 'data: {"error": {"message": "KV tags differ", "type": "kv_integrity_error", "param": null}}\n\n'
        yield "data: [DONE]\n\n"
    finally:
        closed.append(True)


def test_an_error_chunk_fails_the_response_and_closes_the_chat_stream():
    closed: list[bool] = []
    kept: list[dict] = []
    builder = OutputBuilder("resp_1", "m", {"metadata": {}}, lambda text: len(text))
    events = [json.loads(block.split("data: ", 1)[1]) for block in stream_events(builder, chat_chunks(closed),
                                                                                 kept.append)]
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-2]["code"] == "kv_integrity_error" and events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    assert closed == [True] and kept == []
