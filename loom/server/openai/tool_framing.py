"""Chat responses whose answer may be tool calls (loom/server/openai/tools.py), framed as
OpenAI frames them.

Streamed: a forced function's arguments stream as they come, in `tool_calls` deltas (the first
with the call's id and name, then `function.arguments` pieces). With `auto` or `required` the
answer is only known whole, so it is held and sent in the last chunk: content, or the calls.
Whole: the message has `content` (null for calls) and `tool_calls`. A choice ending on calls
has finish reason `tool_calls`; one that max_tokens cut keeps `length`, streamed or whole alike
(a named function's partial arguments are its call's, which a client's parser finds invalid).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.core.request_output import RequestOutput
from loom.server.openai.requests import Ask
from loom.server.openai.responses import OpenAIFraming, event
from loom.server.openai.tools import ToolUse, call


class ToolFraming(OpenAIFraming):
    def __init__(self, ask: Ask, **settings: Any) -> None:
        super().__init__(ask, **settings)
        if ask.tools is None:
            raise ValueError("ToolFraming frames a chat request with tools")
        self.use: ToolUse = ask.tools
        self.held: dict[int, list[str]] = {}  # auto and required: each choice's text so far

    def chunks(
        self,
        index: int,
        batch: Sequence[RequestOutput],
        finish: str | None,
        said: dict[str, str] | None = None,
    ) -> bytes:
        self.sent = True
        said = {"content": "".join(o.text for o in batch)} if said is None else said
        text = said.get("content", "")
        first = b""
        if index not in self.began:
            self.began.add(index)
            role = self.piece(index, {"role": "assistant", "content": None})
            role["logprobs"] = None
            first = event(self.chunk([role]))
            if self.use.mode == "named":
                opened = call(self.use.name, "")
                first += event(
                    self.chunk([self.piece(index, {"tool_calls": [{"index": 0, **opened}]})])
                )
        if "reasoning_content" in said:  # a reasoning parser's: streamed as it comes
            reasoning = {"reasoning_content": said["reasoning_content"]}
            first += event(self.chunk([self.piece(index, reasoning)]))
        if self.use.mode == "named":
            arguments = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
            return first + event(self.chunk([self.piece(index, arguments, self.reason(finish))]))
        held = self.held.setdefault(index, [])
        held.append(text)
        if finish is None:
            return first
        content, calls = self.use.calls("".join(held))
        piece: dict[str, Any] = {"content": content}
        if calls:
            piece = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
        return first + event(
            self.chunk([self.piece(index, piece, self.reason(finish, bool(calls)))])
        )

    def whole(self) -> dict[str, Any]:
        """As the stream frames it: an answer that holds calls is them (a named function's
        arguments always, even cut by max_tokens: finish `length` says they are incomplete)."""
        result = super().whole()
        for item in result["choices"]:
            content, calls = self.use.calls(item["message"]["content"])
            if calls:
                thought = item["message"].get("reasoning_content")
                item["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                if thought is not None:
                    item["message"]["reasoning_content"] = thought
                item["finish_reason"] = self.reason(item["finish_reason"])
        return result

    def reason(self, finish: str | None, calls: bool = True) -> str | None:
        """`tool_calls` for a choice that ended on its calls, else the finish as it is."""
        return "tool_calls" if finish == "stop" and calls else finish
