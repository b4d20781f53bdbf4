"""The SSE reader alone (loom/client/sse.py): events split wherever the bytes are cut."""

from __future__ import annotations

import pytest

from loom.client.sse import DONE, SseReader, events

BODY = b'data: {"a": 1}\n\ndata: {"b": [2]}\n\ndata: [DONE]\n\n'


def test_sse_events_come_whole_however_the_bytes_are_cut() -> None:
    for cut in range(1, len(BODY)):
        reader = SseReader()
        found = reader.feed(BODY[:cut]) + reader.feed(BODY[cut:])
        assert found == [{"a": 1}, {"b": [2]}, DONE]
        assert reader.pending == b""


def test_sse_a_body_that_ends_inside_an_event_or_is_not_data_is_refused() -> None:
    assert events(BODY) == [{"a": 1}, {"b": [2]}, DONE]
    with pytest.raises(ValueError, match="ends inside"):
        events(BODY[:-1])
    with pytest.raises(ValueError, match="not one data line"):
        events(b"event: x\ndata: {}\n\n")
