"""OpenAI's Response object and its stream of events (`POST /v1/responses`), framed for the
relay (loom/server/relay.py `Framing`) as chat's are (loom/server/openai/responses.py).

Streamed (`text/event-stream`; each event `event: TYPE` and `data: {json}` holding its `type`
and `sequence_number`): `response.created` and `response.in_progress` (the Response, in
progress, no output yet); for a text answer `response.output_item.added` (the message),
`response.content_part.added`, `response.output_text.delta` as the text comes,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done`; then
`response.completed`, or `response.incomplete` where max_output_tokens cut the answer, carrying
the whole Response with its usage. With tools the answer is known only whole (it may be calls):
its items (a message, function calls) and their events come at the end, a call's arguments in
one `response.function_call_arguments.delta`, then `.done`. An end that is not a finish after
the stream began is an `error` event. Whole: the Response object alone.

With `--reasoning-parser`, the thinking is an item of its own before the message (`{"type":
"reasoning", "content": [{"type": "reasoning_text", "text"}], "summary": []}`), streamed as
`response.output_item.added`, `response.reasoning_text.delta` as it comes,
`response.reasoning_text.done` and `response.output_item.done`, then the message's events; the
message's text is the answer alone, and usage counts the thinking's tokens in
`output_tokens_details.reasoning_tokens`. Items are opened as their first text comes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from loom.core.request_output import RequestOutput
from loom.server.openai.errors import StreamEndedError, finish_error
from loom.server.openai.json_body import Whole
from loom.server.openai.responses import OpenAIFraming
from loom.server.openai.responses_input import ResponsesAsk


class ResponsesFraming(OpenAIFraming):
    def __init__(self, ask: ResponsesAsk, *, request_id: str, **settings: Any) -> None:
        super().__init__(ask, chat=True, request_id=request_id, **settings)
        self.settings = ask.settings
        self.id = f"resp_{request_id}"
        self.message_id = f"msg_{request_id}"
        self.reasoning_id = f"rs_{request_id}"
        self.sequence = 0
        self.status = "in_progress"
        self.items: list[dict[str, Any]] = []  # the output, made once the answer is whole
        self.error: dict[str, Any] | None = None
        self.thought = self.answer = ""  # the thinking and the answer, split as they come
        self.places: dict[str, int] = {}  # a streamed item's output_index, once it is added

    # The relay's calls

    def delta(self, index: int, batch: Sequence[RequestOutput]) -> bytes | None:
        events = self.begun() if self.ask.stream else b""
        events += self.take(index, batch, last=False)
        return events if self.ask.stream else None

    def final(self, index: int, batch: Sequence[RequestOutput], done: bool) -> bytes | Whole | None:
        opening = self.begun() if self.ask.stream else b""  # in progress, before the end
        events = opening + self.take(index, batch, last=True)
        self.status = "incomplete" if self.choices[index].finish_reason == "length" else "completed"
        self.items = self.output()
        if not self.ask.stream:
            return Whole(self.response())
        return events + self.ended()

    def abnormal(self, index: int, batch: Sequence[RequestOutput]) -> tuple[Any, Exception]:
        error = finish_error(batch[-1])
        if not self.ask.stream or not self.sent:
            return None, error
        events = self.take(index, batch[:-1], last=True)  # what came before, as chat sends it
        events += self.event("error", code=error.code, message=error.message, param=error.param)
        self.status, self.error = "failed", {"code": error.code, "message": error.message}
        events += self.event("response.failed", response=self.response())
        return events, StreamEndedError(error)

    def take(self, index: int, batch: Sequence[RequestOutput], last: bool) -> bytes:
        """A batch's text, split into thinking and answer; streamed: their events."""
        self.choices[index].add(batch, keep=True)
        said = self.said(index, batch, last)
        thought, answer = said.get("reasoning_content", ""), said.get("content", "")
        self.thought, self.answer = self.thought + thought, self.answer + answer
        if not self.ask.stream or self.ask.tools is not None:
            return b""  # with tools, every item comes at the end
        events = b""
        if thought:
            events += self.open_item("reasoning")
            at = {"item_id": self.reasoning_id, "output_index": self.places["reasoning"]}
            events += self.event(
                "response.reasoning_text.delta", **at, content_index=0, delta=thought
            )
        if answer:
            events += self.open_item("message")
            at = self.text_place(self.places["message"])
            events += self.event("response.output_text.delta", **at, delta=answer, logprobs=[])
        return events

    # Events

    def event(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        body = json.dumps(data, ensure_ascii=False).encode()
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"

    def begun(self) -> bytes:
        """The stream's first events, once."""
        if self.sent:
            return b""
        self.sent = True
        events = self.event("response.created", response=self.response())
        return events + self.event("response.in_progress", response=self.response())

    def open_item(self, kind: str) -> bytes:
        """A streamed item's added events, once, as its first text comes (the message's: once
        the reasoning, if any, has closed)."""
        if kind in self.places:
            return b""
        events = self.close_reasoning() if kind == "message" else b""
        self.places[kind] = len(self.places)
        item = self.reasoning_item("") if kind == "reasoning" else self.message("")
        return events + self.opened(self.places[kind], {**item, **self.unfinished(item)})

    def close_reasoning(self) -> bytes:
        if "reasoning" not in self.places or "message" in self.places:
            return b""
        at, item = self.places["reasoning"], self.reasoning_item(self.thought, "completed")
        events = self.event(
            "response.reasoning_text.done",
            item_id=self.reasoning_id, output_index=at, content_index=0, text=self.thought,
        )  # fmt: skip
        return events + self.event("response.output_item.done", output_index=at, item=item)

    def ended(self) -> bytes:
        """The items' closing events (with tools, all of each item's), then the Response."""
        events = b"" if self.ask.tools is not None else self.open_item("message")
        for index, item in enumerate(self.items):
            if self.ask.tools is not None:
                events += self.opened(index, {**item, **self.unfinished(item)})
            if item["type"] == "reasoning":  # (streamed, it closed as the message opened)
                at = {"item_id": self.reasoning_id, "output_index": index, "content_index": 0}
                if self.ask.tools is not None:
                    events += self.event("response.reasoning_text.delta", **at, delta=self.thought)
                    events += self.event("response.reasoning_text.done", **at, text=self.thought)
                    events += self.event("response.output_item.done", output_index=index, item=item)
                continue
            if item["type"] == "message":
                at, part = self.text_place(index), item["content"][0]
                if self.ask.tools is not None:
                    events += self.event(
                        "response.output_text.delta", **at, delta=part["text"], logprobs=[]
                    )
                events += self.event(
                    "response.output_text.done", **at, text=part["text"], logprobs=[]
                )
                events += self.event("response.content_part.done", **at, part=part)
            else:
                at = {"item_id": item["id"], "output_index": index}
                arguments = item["arguments"]
                events += self.event(
                    "response.function_call_arguments.delta", **at, delta=arguments
                )
                events += self.event(
                    "response.function_call_arguments.done", **at, arguments=arguments
                )
            events += self.event("response.output_item.done", output_index=index, item=item)
        return events + self.event(f"response.{self.status}", response=self.response())

    def opened(self, index: int, item: dict[str, Any]) -> bytes:
        events = self.event("response.output_item.added", output_index=index, item=item)
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            events += self.event("response.content_part.added", **self.text_place(index), part=part)
        return events

    def text_place(self, index: int) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": index, "content_index": 0}

    def unfinished(self, item: dict[str, Any]) -> dict[str, Any]:
        """What an item is as it is added: in progress, empty."""
        empty: dict[str, Any] = {"content": []}
        if item["type"] == "function_call":
            empty = {"arguments": ""}
        return {"status": "in_progress", **empty}

    # The Response

    def output(self) -> list[dict[str, Any]]:
        text = self.answer if self.reasoning is not None else "".join(self.choices[0].text)
        thinking = [self.reasoning_item(self.thought, self.status)] if self.thought else []
        if self.ask.tools is None:
            return [*thinking, self.message(text)]
        content, calls = self.ask.tools.calls(text)
        items = [*thinking, *([self.message(content)] if content else [])]
        for call in calls:
            function = call["function"]
            items.append({
                "type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}",
                "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"], "status": self.status,
            })  # fmt: skip
        return items

    def message(self, text: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "type": "message", "id": self.message_id, "status": self.status, "role": "assistant",
            "content": [part],
        }  # fmt: skip

    def reasoning_item(self, text: str, status: str = "in_progress") -> dict[str, Any]:
        return {
            "type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }  # fmt: skip

    def response(self) -> dict[str, Any]:
        finished = self.status != "in_progress"
        cut = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": self.status, "error": self.error, "incomplete_details": cut,
            "model": self.model, "output": self.items if finished else [],
            "usage": self.responses_usage() if finished else None,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "truncation": "disabled", **self.settings,
        }  # fmt: skip

    def responses_usage(self) -> dict[str, Any]:
        usage = self.usage()
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": usage.get(
                "completion_tokens_details", {"reasoning_tokens": 0}
            ),
            "total_tokens": usage["total_tokens"],
        }
