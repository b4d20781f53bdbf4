"""OpenAI's Responses API (`POST /v1/responses`) on a real server, through the official `openai`
client's `responses.create`: plain, streamed (every event type in order, the text the whole
answer's at temperature 0), the chat's tokens for the same messages, a JSON schema, a function
tool (whole and streamed); raw HTTP for the refusals (what a stateless server cannot do, what
is malformed or past a limit: a 400 naming the Responses field) and a client that goes away.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import trio

from loom.model.loader import LoadedModel
from loom.server.openai.config import HttpConfig
from tests.support.http_client import openai_client, post
from tests.support.server_harness import closed_mid_answer, serving

HTTP = HttpConfig(http_port=0)
MODEL = "tiny-llama"
ASKED = "Name three colours."
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def collapsed(kinds: list[str]) -> list[str]:
    """The event types in order, a run of deltas as one."""
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


async def test_responses_plain_streamed_and_as_chat_through_the_openai_client(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def talk() -> tuple[Any, list[Any], Any, Any, Any]:
            settings: dict[str, Any] = {"model": MODEL, "max_output_tokens": 12, "temperature": 0}
            whole = client.responses.create(input=ASKED, instructions="Be brief.", **settings)
            events = list(client.responses.create(
                input=[{"role": "user", "content": [{"type": "input_text", "text": ASKED}]}],
                instructions="Be brief.", stream=True, **settings,
            ))  # fmt: skip
            chat = client.chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": ASKED},
                ],
                max_tokens=12,
                temperature=0,
            )
            long = client.responses.create(input=ASKED, model=MODEL, max_output_tokens=400)
            with client.responses.stream(input=ASKED, model=MODEL, max_output_tokens=1) as one:
                one_events = list(one)  # the helper checks the events' order and identities
            one_token = (one_events, one_events[-1].response)
            return whole, events, chat, long, one_token

        with trio.fail_after(60):
            whole, events, chat, long, (one_events, one) = await trio.to_thread.run_sync(talk)
    assert whole.object == "response"
    assert whole.id.startswith("resp_")
    assert whole.output_text == chat.choices[0].message.content
    assert whole.output_text
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    cut = whole.status == "incomplete"
    assert cut == (chat.choices[0].finish_reason == "length")
    assert (whole.incomplete_details.reason if cut else None) == (
        "max_output_tokens" if cut else None
    )
    kinds = [e.type for e in events]
    assert collapsed(kinds) == [*TEXT_EVENTS, f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert long.status in ("completed", "incomplete")
    assert collapsed([e.type for e in one_events]) == [*TEXT_EVENTS, "response.incomplete"]
    assert one_events[0].response.status == "in_progress"
    assert one_events[0].response.output == []
    assert one.usage.output_tokens == 1


async def test_responses_a_json_schema_and_a_function_tool_whole_and_streamed(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def talk() -> tuple[Any, Any, tuple[list[Any], Any]]:
            fmt = {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}
            structured = client.responses.create(
                model=MODEL, input=ASKED, max_output_tokens=200, text={"format": fmt}
            )
            choice = {"type": "function", "name": "get_weather"}
            # Greedy: the whole and the streamed answers are compared, token for token.
            called = client.responses.create(
                model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice=choice,
                max_output_tokens=100, temperature=0,
            )  # fmt: skip
            with client.responses.stream(
                model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice=choice,
                max_output_tokens=100, temperature=0,
            ) as stream:  # fmt: skip
                streamed = list(stream)
                final = stream.get_final_response()
            return structured, called, (streamed, final)

        with trio.fail_after(60):
            structured, called, (streamed, final) = await trio.to_thread.run_sync(talk)
    assert structured.status == "completed"
    jsonschema.validate(json.loads(structured.output_text), SCHEMA)
    [item] = called.output
    assert item.type == "function_call"
    assert item.name == "get_weather"
    assert item.call_id.startswith("call_")
    assert json.loads(item.arguments)["city"] in ("Paris", "Oslo")
    kinds = collapsed([e.type for e in streamed])
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == json.loads(item.arguments)
    added = next(e for e in streamed if e.type == "response.output_item.added")
    assert added.item.status == "in_progress"
    assert (added.item.id, added.item.call_id) == (final.output[0].id, final.output[0].call_id)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 5}}}, "text.format"),
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
        ({"input": [{"role": "user", "content": "hi"}] * 4097}, "input"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 600}, "input"),  # the input and the answer past the context
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"logit_bias": {"5": 10**400}}, "logit_bias"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input"),
        (
            {"input": [{"type": "function_call", "name": {}, "call_id": "c", "arguments": "{}"}]},
            "input",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": None}]}, "input"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
    ],
)
async def test_responses_what_it_cannot_do_is_a_400_naming_the_field(
    tiny_chat: LoadedModel, change: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": ASKED, **change}
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            status, _, raw = await post(server.http_port or 0, "/v1/responses", body)
    error = json.loads(raw)["error"]
    assert status == 400, raw
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}


async def test_responses_a_closed_connection_aborts_its_response_at_once(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            for stream in (True, False):
                body = {
                    "input": ASKED, "max_output_tokens": 470, "ignore_eos": True, "stream": stream,
                }  # fmt: skip
                seconds = await closed_mid_answer(server, "/v1/responses", body)
                assert seconds < 0.5, (stream, seconds)
            assert "length" not in server.engine.stats().finished
