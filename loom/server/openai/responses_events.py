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
        self.sequence = 0
        self.status = "in_progress"
        self.items: list[dict[str, Any]] = []  # the output, made once the answer is whole
        self.error: dict[str, Any] | None = None

    # The relay's calls

    def delta(self, index: int, batch: Sequence[RequestOutput]) -> bytes | None:
        self.choices[index].add(batch, keep=True)
        return self.begun() + self.text_delta(batch) if self.ask.stream else None

    def final(self, index: int, batch: Sequence[RequestOutput], done: bool) -> bytes | Whole | None:
        choice = self.choices[index]
        choice.add(batch, keep=True)
        opening = self.begun() if self.ask.stream else b""  # in progress, before the end
        self.status = "incomplete" if choice.finish_reason == "length" else "completed"
        self.items = self.output()
        if not self.ask.stream:
            return Whole(self.response())
        return opening + self.text_delta(batch) + self.ended()

    def abnormal(self, index: int, batch: Sequence[RequestOutput]) -> tuple[Any, Exception]:
        error = finish_error(batch[-1])
        if not self.ask.stream or not self.sent:
            return None, error
        if len(batch) > 1:  # what came before the end, as chat's stream sends it
            self.choices[index].add(batch[:-1], keep=True)
        events = self.text_delta(batch[:-1])
        events += self.event("error", code=error.code, message=error.message, param=error.param)
        self.status, self.error = "failed", {"code": error.code, "message": error.message}
        events += self.event("response.failed", response=self.response())
        return events, StreamEndedError(error)

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
        events += self.event("response.in_progress", response=self.response())
        if self.ask.tools is None:  # the text streams as it comes
            message = self.message("")
            events += self.opened(0, {**message, **self.unfinished(message)})
        return events

    def text_delta(self, batch: Sequence[RequestOutput]) -> bytes:
        text = "".join(o.text for o in batch)
        if self.ask.tools is not None or not text:
            return b""
        at = self.text_place(0)
        return self.event("response.output_text.delta", **at, delta=text, logprobs=[])

    def ended(self) -> bytes:
        """The items' closing events (with tools, all of each item's), then the Response."""
        events = b""
        for index, item in enumerate(self.items):
            if self.ask.tools is not None:
                events += self.opened(index, {**item, **self.unfinished(item)})
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
        empty: dict[str, Any] = {"content": []} if item["type"] == "message" else {"arguments": ""}
        return {"status": "in_progress", **empty}

    # The Response

    def output(self) -> list[dict[str, Any]]:
        text = "".join(self.choices[0].text)
        if self.ask.tools is None:
            return [self.message(text)]
        content, calls = self.ask.tools.calls(text)
        items = [self.message(content)] if content else []
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
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }
