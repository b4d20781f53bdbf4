"""A server-sent-event stream's events (OpenAI's streaming responses), as its bytes arrive:
each `data: {json}` event parsed, the closing `data: [DONE]` as the string DONE."""

from __future__ import annotations

import json
from typing import Any

DONE = "[DONE]"


class SseReader:
    def __init__(self) -> None:
        self.pending = b""  # the start of an event not yet whole

    def feed(self, data: bytes) -> list[Any]:
        """The events that `data` completes, in order. ValueError for an event that is not
        one `data:` line."""
        *whole, self.pending = (self.pending + data).split(b"\n\n")
        return [parsed(event) for event in whole]


def parsed(event: bytes) -> Any:
    if not event.startswith(b"data: ") or b"\n" in event:
        raise ValueError(f"not one data line: {event[:80]!r}")
    data = event.removeprefix(b"data: ")
    return DONE if data == b"[DONE]" else json.loads(data)


def events(body: bytes) -> list[Any]:
    """A whole SSE body's events. ValueError if it ends inside one."""
    reader = SseReader()
    found = reader.feed(body)
    if reader.pending:
        raise ValueError(f"the body ends inside an event: {reader.pending[:80]!r}")
    return found
