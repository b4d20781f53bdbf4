"""Tool calls framed for OpenAI's clients, streamed and whole, from the outputs a choice gets
(socket-free: the framing is a pure function of them). Each answer below is one a model may
write; whichever way it is asked for, a client sees one shape: the calls, or the content."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loom.core.request_output import FinishReason, RequestOutput, Usage
from loom.server.openai.json_body import render
from loom.server.openai.requests import chat_ask
from loom.server.openai.tokens import TokenTexts
from loom.server.openai.tool_framing import ToolFraming
from tests.server.openai.test_tools import TOOLS

VALID = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
NAMED = {"type": "function", "function": {"name": "add"}}


def framed(choice: Any, text: str, finish: FinishReason, stream: bool) -> dict[str, Any]:
    """What a client assembles from the framing of `text` (two outputs, then the finish):
    the message's content and calls, and the finish reason."""
    body = {"messages": [{"role": "user", "content": "2 + 3?"}], "tools": TOOLS, "stream": stream}
    body["tool_choice"] = choice
    framing = ToolFraming(
        chat_ask(body, 4), chat=True, request_id="r", model="m", tokens=TokenTexts(None)
    )
    half = len(text) // 2
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    sent = [framing.delta(0, [RequestOutput(request_id="r", text=text[:half])])]
    last = RequestOutput(request_id="r", text=text[half:], finish_reason=finish, usage=usage)
    sent.append(framing.final(0, [last], done=True))
    if not stream:
        (message,) = [json.loads(render(s.value)) for s in sent if s is not None]
        (item,) = message["choices"]
        return {**item["message"], "finish_reason": item["finish_reason"]}
    content, calls, reason = "", {}, None
    for event in b"".join(s for s in sent if s).split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        (item,) = json.loads(event[6:])["choices"]
        reason = item["finish_reason"] or reason
        content += item["delta"].get("content") or ""
        for delta in item["delta"].get("tool_calls") or []:
            found = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            found["name"] += delta["function"].get("name") or ""
            found["arguments"] += delta["function"].get("arguments") or ""
    listed = [calls[i] for i in sorted(calls)]
    return {"content": content or None, "tool_calls": listed or None, "finish_reason": reason}


def shape(answer: dict[str, Any]) -> tuple[Any, Any, Any]:
    calls = answer.get("tool_calls") or []
    names = [(c.get("function", c)["name"], c.get("function", c)["arguments"]) for c in calls]
    return answer.get("content"), names or None, answer["finish_reason"]


@pytest.mark.parametrize(
    ("choice", "text", "finish", "expected"),
    [
        ("auto", VALID, FinishReason.STOP,
         (None, [("add", '{"a": 2, "b": 3}')], "tool_calls")),
        # max_tokens came right after a whole call: the call, and `length`
        ("auto", VALID, FinishReason.LENGTH, (None, [("add", '{"a": 2, "b": 3}')], "length")),
        # malformed: content, never a 500 (a list for a name raised a TypeError)
        ("auto", '<tool_call>{"name": [], "arguments": {}}</tool_call>', FinishReason.STOP,
         ('<tool_call>{"name": [], "arguments": {}}</tool_call>', None, "stop")),
        ("auto", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', FinishReason.STOP,
         ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', None, "stop")),
        ("auto", '<tool_call>{"name": "add", "argu', FinishReason.LENGTH,
         ('<tool_call>{"name": "add", "argu', None, "length")),
        # a named function cut by max_tokens: its call, arguments unfinished, and `length`
        # (whole used to put the arguments in `content`: LangChain saw no call at all)
        (NAMED, '{"a": 2, "b"', FinishReason.LENGTH, (None, [("add", '{"a": 2, "b"')], "length")),
        (NAMED, '{"a": 2, "b": 3}', FinishReason.STOP,
         (None, [("add", '{"a": 2, "b": 3}')], "tool_calls")),
        ("required", '[{"name": "add", "arguments": {"a": 2', FinishReason.LENGTH,
         ('[{"name": "add", "arguments": {"a": 2', None, "length")),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_tool_framing_streamed_and_whole_give_one_shape(
    choice: Any, text: str, finish: FinishReason, expected: tuple[Any, ...], stream: bool
) -> None:
    assert shape(framed(choice, text, finish, stream)) == expected
