"""logit_bias through every front, on a real server: OpenAI's HTTP API (the official `openai`
client, raw HTTP for the refusals), loom.v1's gRPC and the vLLM protocol (grpclib). +100 makes
a token every token sampled at temperature 1; -100 on each token of the greedy answer keeps all
of them out of it; a map past the limits (too many ids, an id past the vocabulary, a bias past
100, a key that is no id) is refused naming logit_bias, and a million entries are refused unread.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from grpclib import GRPCError, Status
from grpclib.client import Channel

from loom.core.sampling_params import MAX_LOGIT_BIAS
from loom.model.loader import LoadedModel
from loom.server.openai.config import HttpConfig
from loom.smg import vllm_engine_pb2 as vllm
from loom.smg.vllm_engine_grpc import VllmEngineStub
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, in_asyncio, token_ids
from tests.support.http_client import openai_client, post
from tests.support.server_harness import serving

HTTP = HttpConfig(http_port=0)
CHAT = [{"role": "user", "content": "Name three colours."}]
FORCED = 4242  # a token the tiny random model is not drawn to
PROMPT = [1, 5, 9, 200, 31, 7]


async def test_logit_bias_forces_and_bans_tokens_through_the_openai_client(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat, http=HTTP) as (server, _):
        client = openai_client(server.http_port or 0)

        def talk() -> tuple[list[int], list[int], list[int]]:
            ids = {"return_token_ids": True}
            plain = client.completions.create(
                model="tiny-llama", prompt="Once upon", max_tokens=8, temperature=0, extra_body=ids
            )
            greedy = plain.choices[0].model_extra["token_ids"]  # type: ignore[index]
            banned = client.completions.create(
                model="tiny-llama",
                prompt="Once upon",
                max_tokens=8,
                temperature=0,
                logit_bias={str(t): -100 for t in greedy},
                extra_body=ids,
            )
            forced = client.chat.completions.create(
                model="tiny-llama",
                messages=CHAT,  # type: ignore[arg-type]
                max_tokens=8,
                temperature=1.0,
                logit_bias={str(FORCED): 100},
                extra_body={**ids, "ignore_eos": True},
            )
            return (
                greedy,
                banned.choices[0].model_extra["token_ids"],  # type: ignore[index]
                forced.choices[0].model_extra["token_ids"],  # type: ignore[index]
            )

        with trio.fail_after(60):
            greedy, banned, forced = await trio.to_thread.run_sync(talk)
    assert len(banned) == 8
    assert not set(banned) & set(greedy)
    assert forced == [FORCED] * 8


def many(count: int) -> dict[str, float]:
    return dict.fromkeys(map(str, range(count)), 1.0)


@pytest.mark.parametrize(
    ("bias", "says"),
    [
        (many(MAX_LOGIT_BIAS + 1), f"at most {MAX_LOGIT_BIAS} token ids"),
        (many(100_000), f"at most {MAX_LOGIT_BIAS} token ids"),
        ({"49152": 1.0}, "[0, 49152) (the vocabulary size), got 49152"),
        ({"5": 100.5}, "[-100, 100], got 100.5"),
        ({"5": float("nan")}, "[-100, 100], got nan"),
        ({"-5": 1.0}, "keys must be token ids"),
        ({"five": 1.0}, "keys must be token ids"),
        ({"5": "1"}, "values must be numbers"),
        ([5, 1], "must be an object"),
    ],
)
async def test_logit_bias_past_its_limits_is_a_400_naming_it(
    tiny_chat: LoadedModel, bias: Any, says: str
) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "logit_bias": bias}
    raw_body = json.dumps(body).encode()  # NaN as JavaScript's, which Python's parser reads
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            status, _, raw = await post(server.http_port or 0, "/v1/chat/completions", raw_body)
    error = json.loads(raw)["error"]
    assert status == 400, raw
    assert error["param"] == "logit_bias"
    assert says in error["message"]


async def test_logit_bias_of_a_million_ids_is_refused_unread(tiny_chat: LoadedModel) -> None:
    body = json.dumps({"messages": CHAT, "logit_bias": many(1_000_000)}).encode()
    async with serving(tiny_chat, http=HTTP) as (server, _):
        with trio.fail_after(60):
            status, _, raw = await post(server.http_port or 0, "/v1/chat/completions", body)
    assert status == 413, raw


async def loom_generate(port: int, bias: dict[int, float]) -> list[int]:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, logit_bias=bias),
    )
    async with Channel(HOST, port) as channel:
        return token_ids(list(await LoomStub(channel).Generate(request, timeout=20)))


async def vllm_generate(port: int, bias: dict[int, float]) -> list[int]:
    params = vllm.SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, logit_bias=bias)
    request = vllm.GenerateRequest(
        request_id="r", tokenized=vllm.TokenizedInput(input_ids=PROMPT), sampling_params=params
    )
    async with Channel(HOST, port) as channel:
        replies = list(await VllmEngineStub(channel).Generate(request, timeout=20))
    return list(replies[-1].complete.output_ids)


@pytest.mark.parametrize("generate", [loom_generate, vllm_generate], ids=["loom.v1", "vllm"])
async def test_logit_bias_through_grpc_forces_a_token_and_refuses_past_its_limits(
    tiny_chat: LoadedModel, generate: Any
) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            forced = await in_asyncio(generate, port, {FORCED: 100.0})
            refusals = []
            for bias in (dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0), {49152: 1.0}, {5: -101.0}):
                with pytest.raises(GRPCError) as refused:
                    await in_asyncio(generate, port, bias)
                refusals.append(refused.value)
    assert forced == [FORCED] * 6
    assert all(r.status is Status.INVALID_ARGUMENT for r in refusals)
    assert all("logit_bias" in (r.message or "") for r in refusals)
