"""Structured outputs through both fronts: the gRPC `constraint` oneof (grpclib), OpenAI's
`response_format` and vLLM's `structured_outputs` (the official `openai` client), streamed and
whole; refusals as INVALID_ARGUMENT and 400 at once, while other requests are served; and the
real SmolLM2 answering a schema.

Rules: loopback only, port 0, a timeout on every I/O test; real server, real clients.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from loom.client.sse import events
from loom.model.loader import LoadedModel
from loom.server.openai.config import HttpConfig
from loom.v1 import loom_pb2 as pb
from tests.engine.test_constraints import SCHEMAS
from tests.support.grpc_client import generate, in_asyncio
from tests.support.http_client import openai_client, post
from tests.support.server_harness import serving

HTTP = HttpConfig(http_port=0)
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]


def text_of(responses: list[pb.GenerateResponse]) -> tuple[str, int]:
    """The streamed text and the finish reason."""
    text = "".join(r.delta.text for r in responses if r.HasField("delta"))
    final = responses[-1].final
    return text + final.delta.text, final.finish_reason


def chat_request(**sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text="Answer:", sampling=pb.SamplingParams(max_tokens=150, seed=3, **sampling)
    )


async def test_structured_grpc_schema_regex_and_choice(tiny_chat: LoadedModel) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(120):
            schema_out = await in_asyncio(
                generate, port, chat_request(json_schema=json.dumps(SCHEMAS[0]))
            )
            regex_out = await in_asyncio(generate, port, chat_request(regex=r"[0-9]{3}-[0-9]{4}"))
            choices = ["alpha", "beta", "gamma delta"]
            choice_out = await in_asyncio(
                generate, port, chat_request(choice=pb.Choices(choices=choices))
            )
    text, reason = text_of(schema_out)
    assert reason == pb.FINISH_REASON_STOP, text
    jsonschema.validate(json.loads(text), SCHEMAS[0])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text_of(regex_out)[0])
    assert text_of(choice_out)[0] in choices


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"json_schema": '{"type": "nope"}'}, "json_schema is not valid"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: x\n"}, 'unknown name: "x"'),
        ({"regex": "a" * 70000}, "max_constraint_bytes=65536"),
        ({"json_object": False}, "json_object must be true"),
        ({"choice": pb.Choices(choices=[str(i) for i in range(257)])}, "1 to 256 choices, got 257"),
        ({"regex": "a+", "ignore_eos": True}, "cannot be combined with a constraint"),
        ({"regex": "a+", "stop": [","]}, "stop cannot be combined with a constraint"),
    ],
)
async def test_structured_grpc_refusals_are_invalid_argument(
    tiny_chat: LoadedModel, sampling: dict[str, Any], message: str
) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            with pytest.raises(GRPCError) as info:
                await in_asyncio(generate, port, chat_request(**sampling))
            assert info.value.status is Status.INVALID_ARGUMENT
            assert message in (info.value.message or "")
            served = await in_asyncio(generate, port, chat_request())  # the server goes on
    assert text_of(served)[1] == pb.FINISH_REASON_LENGTH


def person_format() -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMAS[0], "strict": True},
    }


async def test_structured_openai_response_format_and_structured_outputs(
    tiny_chat: LoadedModel,
) -> None:
    """Through the official client: a json_schema response_format, whole and streamed (the
    same text), and vLLM's structured_outputs choice and regex in `extra_body`."""
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def ask() -> dict[str, Any]:
            common: Any = {"model": "tiny-llama", "messages": CHAT, "max_tokens": 150, "seed": 5}
            whole = client.chat.completions.create(**common, response_format=person_format())
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    **common, response_format=person_format(), stream=True
                )
                if c.choices
            )
            choice = client.chat.completions.create(
                **common, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
            )
            regex = client.completions.create(
                model="tiny-llama",
                prompt="Phone:",
                max_tokens=20,
                extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
            )
            return {"whole": whole, "streamed": streamed, "choice": choice, "regex": regex}

        with trio.fail_after(120):
            got = await trio.to_thread.run_sync(ask)
    whole = got["whole"].choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), SCHEMAS[0])
    assert got["streamed"] == whole.message.content
    assert got["choice"].choices[0].message.content in ("yes", "no")
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", got["regex"].choices[0].text)


async def test_structured_openai_refusals_are_400s_at_once(tiny_chat: LoadedModel) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    async with serving(tiny_chat, http=HTTP) as (server, _):
        port = server.http_port or 0
        with trio.fail_after(60):
            for extra, message in [
                ({"response_format": bad_schema}, "json_schema is not valid"),
                ({"structured_outputs": {"regex": "a(b"}}, "unclosed group"),
                ({"structured_outputs": {"grammar": "a" * 70000}}, "max_constraint_bytes"),
            ]:
                body = {"messages": CHAT, "max_tokens": 5, **extra}
                status, _, raw = await post(port, "/v1/chat/completions", body)
                assert status == 400, raw
                assert message in json.loads(raw)["error"]["message"]


async def test_structured_a_constraint_failing_mid_stream_ends_with_an_error_event(
    tiny_chat: LoadedModel,
) -> None:
    """A grammar whose lexer blows up only after 12 letters and a "!": the matcher fails
    mid-stream; the stream ends with an error event and [DONE], and the body is whole (it
    was cut: http_errors took the stream's end for a bug)."""
    grammar = 'start: /[a-z]{12}/ x\nx: "!" /(f{1000}){1000}/\n'
    body = {
        "messages": CHAT,
        "max_tokens": 40,
        "stream": True,
        "structured_outputs": {"grammar": grammar},
    }
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(120):
            status, _, raw = await post(server.http_port or 0, "/v1/chat/completions", body)
    assert status == 200
    parsed = events(raw)  # a cut body would have raised in the client's read
    assert parsed[-1] == "[DONE]"
    assert "the constraint failed" in parsed[-2]["error"]["message"]


@pytest.mark.smollm2
async def test_structured_smollm2_answers_a_schema_that_validates(smollm2: LoadedModel) -> None:
    """The real model, through the openai client: a person's record, greedy and sampled, all
    valid, and any JSON object (a trained model ends an object; the tiny random one writes
    a free key forever)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "city": {"type": "string", "maxLength": 30},
            "hobbies": {
                "type": "array",
                "items": {"type": "string", "maxLength": 20},
                "maxItems": 4,
            },
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    messages = [{"role": "user", "content": "Invent a person. Reply in JSON."}]
    async with serving(smollm2, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def ask(seed: int) -> Any:
            return client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=messages,
                max_tokens=120,
                temperature=0 if seed == 0 else 0.8,
                seed=seed,
                response_format=response_format,  # type: ignore[arg-type]
            )

        def ask_any_object() -> Any:
            asked = 'Reply with a JSON object of two keys, "city" and "country", for Paris.'
            return client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": asked}],
                max_tokens=120,
                temperature=0,
                response_format={"type": "json_object"},
            )

        with trio.fail_after(600):
            answers = [await trio.to_thread.run_sync(ask, seed) for seed in range(4)]
            any_object = await trio.to_thread.run_sync(ask_any_object)
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    choice = any_object.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)
