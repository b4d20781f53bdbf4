"""`--reasoning-parser`: a reasoning model's thinking in chat's `reasoning_content`, never in its
`content`, streamed and whole, with the reasoning tokens in usage; through the official
`openai` client, on a tiny Qwen3-shaped model whose tokenizer has `<think>` and `</think>` as
added tokens and whose weights are set so that greedy decoding writes a script: `<think>`,
"abc", `</think>`, "Paris", EOS (each layer adds nothing to the residual stream, and the LM
head maps each token's one-hot embedding to the next token of the script)."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest
import torch
import trio

from loom.model.loader import LoadedModel
from loom.server.openai.config import HttpConfig
from loom.server.openai.reasoning import Reasoning
from tests.conftest import tiny_model
from tests.support.http_client import openai_client, post
from tests.support.server_harness import serving

ASKED = [{"role": "user", "content": "The capital of France?"}]


def scripted(smollm2_tokenizer: Any, script: str) -> LoadedModel:
    """A tiny Qwen3 that answers every chat prompt with `script` then EOS, greedily."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    loaded = tiny_model("qwen3", vocab_size=len(tokenizer), tokenizer=tokenizer)
    prompt = tokenizer.apply_chat_template(ASKED, add_generation_prompt=True, tokenize=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    chain = [prompt[-1], *tokenizer.encode(script, add_special_tokens=False)]
    chain.append(tokenizer.eos_token_id)
    assert len(set(chain)) == len(chain)  # a token's successor is the script's next token
    model = loaded.model.model
    with torch.no_grad():
        for layer in model.layers:  # nothing added to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.embed_tokens.weight.zero_()
        loaded.model.lm_head.weight.zero_()
        for place, (token, following) in enumerate(itertools.pairwise(chain)):
            model.embed_tokens.weight[token, place] = 1.0
            loaded.model.lm_head.weight[following, place] = 10.0
    return loaded


async def asked_twice(tokenizer: Any, parser: str, **settings: Any) -> tuple[Any, list[Any]]:
    """The scripted model's chat answer under `parser`, whole, then streamed (with usage)."""
    loaded = scripted(tokenizer, "<think>abc</think>Paris")
    http = HttpConfig(http_port=0, reasoning_parser=parser)
    settings |= {"model": "tiny-qwen3", "messages": ASKED, "temperature": 0}
    async with serving(loaded, http=http) as (server, _):
        client = openai_client(server.http_port or 0)

        def talk() -> tuple[Any, list[Any]]:
            whole = client.chat.completions.create(**settings)
            usage = {"include_usage": True}
            chunks = list(
                client.chat.completions.create(stream=True, stream_options=usage, **settings)
            )
            return whole, chunks

        with trio.fail_after(60):
            return await trio.to_thread.run_sync(talk)


def streamed(chunks: list[Any]) -> tuple[str, str]:
    """A stream's reasoning_content and content, each joined."""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    return thought, "".join(d.content or "" for d in deltas)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
async def test_reasoning_goes_to_reasoning_content_streamed_and_whole(
    smollm2_tokenizer: Any, parser: str
) -> None:
    whole, chunks = await asked_twice(smollm2_tokenizer, parser, max_tokens=20)
    message = whole.choices[0].message
    assert message.content == "Paris"
    assert message.model_extra["reasoning_content"] == "abc"
    assert whole.usage.completion_tokens == 5  # <think> abc </think> Paris <|im_end|>
    assert whole.usage.completion_tokens_details.reasoning_tokens == 3
    assert streamed(chunks) == ("abc", "Paris")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 3


async def test_without_a_parser_the_thinking_stays_in_the_content(smollm2_tokenizer: Any) -> None:
    loaded = scripted(smollm2_tokenizer, "<think>abc</think>Paris")
    async with serving(loaded, http=HttpConfig(http_port=0)) as (server, _):
        client = openai_client(server.http_port or 0)
        with trio.fail_after(60):
            whole = await trio.to_thread.run_sync(
                lambda: client.chat.completions.create(
                    model="tiny-qwen3",
                    messages=ASKED,
                    temperature=0,  # type: ignore[arg-type]
                )
            )
    assert whole.choices[0].message.content == "<think>abc</think>Paris"
    assert "reasoning_content" not in (whole.choices[0].message.model_extra or {})


@pytest.mark.parametrize(
    ("parser", "pieces", "split"),
    [
        ("qwen3", ["<th", "ink>a", "b</th", "ink>", "Paris"], ("ab", "Paris")),
        ("qwen3", ["Par", "is"], ("", "Paris")),  # thinking off: all answer
        ("qwen3", ["<", "b"], ("", "<b")),  # not a marker after all
        ("deepseek_r1", ["ab", "c</", "think>\n\nParis"], ("abc", "\n\nParis")),
        ("deepseek_r1", ["<think>ab", "c"], ("abc", "")),  # never closed: all reasoning
        ("deepseek_r1", ["ab", "</thi"], ("ab</thi", "")),  # cut mid-marker at the end
    ],
)
def test_reasoning_markers_cut_across_steps_are_matched_whole(
    parser: str, pieces: list[str], split: tuple[str, str]
) -> None:
    reasoning = Reasoning(parser)
    for i, piece in enumerate(pieces):
        reasoning.feed(piece, 1, last=i == len(pieces) - 1)
    assert (reasoning.reasoning, reasoning.content) == split


async def test_a_constraint_that_spells_an_added_token_is_served(smollm2_tokenizer: Any) -> None:
    """The regex spells `<think>`, an added token the model writes: the request is served
    (it failed: "token [49152] doesn't satisfy the grammar")."""
    loaded = scripted(smollm2_tokenizer, "<think>abc</think>Paris")
    async with serving(loaded, http=HttpConfig(http_port=0)) as (server, _):
        client = openai_client(server.http_port or 0)
        with trio.fail_after(60):
            answers = await trio.to_thread.run_sync(
                lambda: [
                    client.chat.completions.create(
                        model="tiny-qwen3",
                        messages=ASKED,  # type: ignore[arg-type]
                        temperature=0,
                        extra_body={"structured_outputs": {"regex": regex}},
                    )
                    for regex in ("<think>abc</think>Paris", "(<think>[a-z]+</think>)?Paris")
                ]
            )
    assert [a.choices[0].message.content for a in answers] == ["<think>abc</think>Paris"] * 2
    assert [a.choices[0].finish_reason for a in answers] == ["stop", "stop"]


def test_reasoning_tokens_are_those_written_while_thinking() -> None:
    """Held text counts only once it proves to open the thinking."""
    not_thinking, thinking = Reasoning("qwen3"), Reasoning("qwen3")
    for split, pieces in ((not_thinking, ["<", "b>hi"]), (thinking, ["<th", "ink>a", "</think>b"])):
        for i, piece in enumerate(pieces):
            split.feed(piece, 1, last=i == len(pieces) - 1)
    assert (not_thinking.tokens, not_thinking.content) == (0, "<b>hi")
    assert (thinking.tokens, thinking.reasoning, thinking.content) == (3, "a", "b")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
async def test_a_constraint_binds_the_answer_after_the_thinking(
    smollm2_tokenizer: Any, parser: str
) -> None:
    """With a reasoning parser, the regex `Rome` constrains the answer only: the thinking is
    the model's own, streamed and whole ("abc", which the regex never allows), and the answer
    after `</think>` is forced to Rome where the model would say Paris. qwen3: the first mask
    allows `<think>` beside the regex's tokens, so the model opens its thinking; the same
    regex on a model that answers without thinking binds from the first token."""
    regex = {"structured_outputs": {"regex": "Rome"}}
    whole, chunks = await asked_twice(smollm2_tokenizer, parser, extra_body=regex)
    message = whole.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("abc", "Rome")
    assert whole.choices[0].finish_reason == "stop"
    assert streamed(chunks) == ("abc", "Rome")


async def test_a_qwen3_answer_that_does_not_think_is_constrained_from_its_first_token(
    smollm2_tokenizer: Any,
) -> None:
    loaded = scripted(smollm2_tokenizer, "Paris")
    http = HttpConfig(http_port=0, reasoning_parser="qwen3")
    async with serving(loaded, http=http) as (server, _):
        client = openai_client(server.http_port or 0)
        with trio.fail_after(60):
            answer = await trio.to_thread.run_sync(
                lambda: client.chat.completions.create(
                    model="tiny-qwen3",
                    messages=ASKED,  # type: ignore[arg-type]
                    temperature=0,
                    extra_body={"structured_outputs": {"regex": "Rome"}},
                )
            )
    assert answer.choices[0].message.content == "Rome"  # the model's own: Paris
    assert not (answer.choices[0].message.model_extra or {}).get("reasoning_content")


async def test_a_constraint_after_the_thinking_needs_the_markers_as_tokens(
    smollm2_tokenizer: Any, tiny_chat: LoadedModel
) -> None:
    """SmolLM2's vocabulary spells `</think>` in several tokens: refused, naming why."""
    http = HttpConfig(http_port=0, reasoning_parser="deepseek_r1")
    async with serving(tiny_chat, http=http) as (server, _):
        body = {"messages": ASKED, "response_format": {"type": "json_object"}}
        status, _, data = await post(server.http_port or 0, "/v1/chat/completions", body)
    assert status == 400, data
    assert b"single tokens" in data


def collapsed(kinds: list[str]) -> list[str]:
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
async def test_responses_give_the_thinking_as_a_reasoning_item(
    smollm2_tokenizer: Any, parser: str
) -> None:
    """/v1/responses: the thinking is a reasoning item before the message, streamed as its
    own events; the message is the answer alone; a JSON schema binds the answer only."""
    loaded = scripted(smollm2_tokenizer, "<think>abc</think>Paris")
    http = HttpConfig(http_port=0, reasoning_parser=parser)
    async with serving(loaded, http=http) as (server, _):
        client = openai_client(server.http_port or 0)

        def talk() -> tuple[Any, list[Any], Any]:
            asked: dict[str, Any] = {"model": "tiny-qwen3", "input": ASKED[0]["content"]}
            whole = client.responses.create(temperature=0, **asked)
            events = list(client.responses.create(temperature=0, stream=True, **asked))
            schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}}
            schema |= {"required": ["city"], "additionalProperties": False}
            text = {"format": {"type": "json_schema", "name": "city", "schema": schema}}
            shaped = client.responses.create(
                temperature=0,
                max_output_tokens=30,
                text=text,
                **asked,  # type: ignore[arg-type]
            )
            return whole, events, shaped

        with trio.fail_after(60):
            whole, events, shaped = await trio.to_thread.run_sync(talk)
    thinking, message = whole.output
    assert (thinking.type, thinking.content[0].text) == ("reasoning", "abc")
    assert (message.type, whole.output_text) == ("message", "Paris")
    assert whole.usage.output_tokens_details.reasoning_tokens == 3
    assert collapsed([e.type for e in events]) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    said = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    answered = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert ("".join(said), "".join(answered)) == ("abc", "Paris")
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    assert shaped.output[0].content[0].text == "abc"
    assert json.loads(shaped.output_text)["city"] in ("Paris", "Rome")
