"""Tool calls through the chat API and the official `openai` client: `tool_choice` required
and named (generated under their functions' schemas: every call parses and validates), auto
(the Hermes parser), streaming as OpenAI streams calls, earlier calls and tool results in
the history, and the refusals.

Rules: loopback only, port 0, a timeout on every I/O test; real server, real client; the tiny
random Llama picks whatever the mask lets through, so a schema it passes is the schema's doing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jsonschema
import pytest
import trio

from loom.model.loader import LoadedModel
from loom.server.openai.config import HttpConfig
from loom.server.openai.tools import HermesParser
from tests.support.http_client import openai_client, post
from tests.support.server_harness import serving

HTTP = HttpConfig(http_port=0)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n}.", "parameters": p}}
    for n, p in SCHEMAS.items()
]
ASKED = [{"role": "user", "content": "What is the weather in Paris? And 2 + 3?"}]


def check_calls(calls: list[Any]) -> None:
    assert calls
    for c in calls:
        assert c["id"].startswith("call_")
        assert c["type"] == "function"
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


def streamed_calls(chunks: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The calls a stream's `tool_calls` deltas add up to, as OpenAI's clients add them."""
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for delta in choice.delta.tool_calls or []:
            found = calls.setdefault(
                delta.index,
                {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
            )
            found["id"] += delta.id or ""
            found["function"]["name"] += delta.function.name or ""
            found["function"]["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason


async def test_tools_required_calls_all_parse_and_validate_streamed_and_whole(
    tiny_chat: LoadedModel,
) -> None:
    """20 of 20 with tool_choice required (10 whole, 10 streamed; sampled, seeded)."""
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def ask(seed: int, stream: bool) -> Any:
            return client.chat.completions.create(
                model="tiny-llama",
                messages=ASKED,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=150,
                seed=seed,
                stream=stream,
            )

        with trio.fail_after(300):
            whole = [await trio.to_thread.run_sync(ask, s, False) for s in range(10)]
            streams = [
                await trio.to_thread.run_sync(lambda s=s: list(ask(s, True))) for s in range(10)
            ]
    for answer in whole:
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        check_calls([c.model_dump() for c in choice.message.tool_calls])
    for chunks in streams:
        calls, reason = streamed_calls(chunks)
        assert reason == "tool_calls"
        check_calls(calls)


async def test_tools_a_named_function_streams_its_arguments_as_they_come(
    tiny_chat: LoadedModel,
) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def ask(stream: bool) -> Any:
            answer = client.chat.completions.create(
                model="tiny-llama",
                messages=ASKED,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                tool_choice=named,  # type: ignore[arg-type]
                max_tokens=100,
                temperature=0,
                stream=stream,
            )
            return list(answer) if stream else answer

        with trio.fail_after(120):
            whole = await trio.to_thread.run_sync(ask, False)
            chunks = await trio.to_thread.run_sync(ask, True)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD)
    assert whole.choices[0].finish_reason == "tool_calls"
    pieces = [
        d.function.arguments
        for c in chunks
        if c.choices
        for d in c.choices[0].delta.tool_calls or []
        if d.function.arguments
    ]
    assert len(pieces) > 3  # the arguments came in pieces, as generated
    streamed, reason = streamed_calls(chunks)
    assert reason == "tool_calls"
    assert streamed[0]["function"] == {"name": "add", "arguments": call.function.arguments}


async def test_tools_auto_takes_the_history_and_refuses_a_grammar_of_the_client_s(
    tiny_chat: LoadedModel,
) -> None:
    """With auto, a history holding an earlier call and its result renders and is served; a
    grammar of the client's beside the tools is a 400 naming both fields (kept, it decided
    what the model wrote inside a call: a regex forcing `<tool_call>` and blanks was how one
    request froze the thread serving every client), whatever tool_choice asks."""
    block = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'
    history = [
        *ASKED,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    refused = []
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)
        followed = await trio.to_thread.run_sync(
            lambda: client.chat.completions.create(
                model="tiny-llama",
                messages=history,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                max_tokens=5,
                temperature=0,
            )
        )
        for constraint in (
            {"structured_outputs": {"regex": block}},
            {"structured_outputs": {"regex": r"<tool_call>\s{4000}"}},
            {"response_format": {"type": "json_object"}},
        ):
            for choice in ("auto", "required"):
                body = {"messages": ASKED, "tools": TOOLS, "tool_choice": choice, **constraint}
                with trio.fail_after(60):
                    refused.append(await post(server.http_port or 0, "/v1/chat/completions", body))
    assert followed.choices[0].finish_reason == "length"
    assert followed.choices[0].message.content
    for status, _, raw in refused:
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert error["param"] == "tool_choice"
        assert (
            "response_format and structured_outputs cannot be combined with tools"
            in (error["message"])
        )


VALID_CALL = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'


def test_tools_hermes_parser_takes_whole_blocks_or_nothing() -> None:
    parser = HermesParser(names={"add"})
    content, calls = parser.parse(
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    assert content == "Sure."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2}]
    for broken in (
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # not JSON
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',  # not a tool
        '<tool_call>{"name": [], "arguments": {}}</tool_call>',  # was a TypeError: a 500
        '<tool_call>{"name": {"add": 1}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "add", "arguments": "{}"}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}}',  # cut by max_tokens
        VALID_CALL + '<tool_call>{"name": "add"',  # all or nothing
        "<tool_call>[1]</tool_call>",
        "no call at all",
    ):
        assert parser.parse(broken) == (broken, [])


PARSE_BLANKS = """
from loom.server.openai.tools import HermesParser
parser = HermesParser(names={"add"})
blanks = " \\n\\t" * 100_000
for text in ("<tool_call>" + blanks, ("<tool_call>" + blanks) * 2 + "</tool_call>",
             "<tool_call>" + blanks + "x" + blanks + "</tool_call>" + blanks):
    assert parser.parse(text) == (text, [])
call = '{"name": "add", "arguments": {}}'
assert parser.parse("<tool_call>" + blanks + call + blanks + "</tool_call>")[1]
"""


def test_tools_hermes_parser_is_linear_in_what_a_model_writes() -> None:
    """300,000 blanks inside and around the tags (a client's grammar forced 4,000 once, and
    the backtracking pattern then took 28 s): parsed at once, in a process of its own so
    that a parser that is not linear fails the test rather than holding it."""
    done = subprocess.run([sys.executable, "-c", PARSE_BLANKS], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def deep_tool(levels: int) -> dict[str, Any]:
    parameters: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        parameters = {"type": "object", "properties": {"a": parameters}}
    return {"type": "function", "function": {"name": "deep", "parameters": parameters}}


async def test_tools_a_history_with_arguments_too_deep_to_read_is_rendered(
    tiny_chat: LoadedModel,
) -> None:
    """An earlier call whose arguments nest 3,000 deep (was a RecursionError: a 500) is
    taken as the text it is: the prompt renders, and is then too long for the tiny model's
    512-token context (a 400 about that, not a 500)."""
    history = [
        *ASKED,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c",
                    "type": "function",
                    "function": {"name": "add", "arguments": "[" * 3000 + "]" * 3000},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "5"},
    ]
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            body = {"messages": history, "max_tokens": 2, "tools": TOOLS, "tool_choice": "none"}
            status, _, raw = await post(server.http_port or 0, "/v1/chat/completions", body)
    assert status == 400, raw
    assert "exceeds the context length of 512 tokens" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": TOOLS + TOOLS}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "structured_outputs": {"choice": ["a", "b"]}}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "add"}}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "bogus", "function": {"name": "add"}}},
            "tool_choice",
        ),
        ({"tools": [deep_tool(100)]}, "tools"),  # was a RecursionError: a 500
        ({"tools": [{**TOOLS[0], "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
        ({"functions": [{"name": "add"}]}, "functions"),
    ],
)
async def test_tools_bad_tools_are_400s_naming_the_field(
    tiny_chat: LoadedModel, extra: dict[str, Any], param: str
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            body = {"messages": ASKED, "max_tokens": 5, **extra}
            status, _, raw = await post(server.http_port or 0, "/v1/chat/completions", body)
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param
