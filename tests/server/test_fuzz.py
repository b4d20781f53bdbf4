"""GenerateRequest fuzzed at a real server: random values for every field, within the proto's
types (huge, tiny, negative, NaN, infinite, empty, repeated). No call may end INTERNAL (or
UNKNOWN), the engine may not crash, and the server must answer correctly afterwards.

Rules: port 0; each example under `fail_after`; a tiny model with a 64-token context, so that
a valid request is short whatever its max_tokens.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
from grpclib import GRPCError, Status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom.engine.engine import EngineState
from loom.v1 import loom_pb2 as pb
from tests.conftest import tiny_model
from tests.support.greedy import reference_tokens
from tests.support.grpc_client import generate, greedy, in_asyncio, token_ids, wait_all_blocks_free
from tests.support.server_harness import serving

INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.one_of(
    st.floats(width=32),  # NaN and the infinities included
    st.sampled_from([0.0, -0.0, 1e-40, 1e-6, 1e-5, 0.5, 1.0, 2.0, 100.0, 1e30, -1.0, math.nan]),
)
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "x" * 5000, "\ufffd\x00🦀"]))
ALLOWED = {Status.OK, Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED}


@st.composite
def sampling(draw: st.DrawFn) -> pb.SamplingParams:
    message = pb.SamplingParams()
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(message, name, draw(FLOATS))
    for name in ("presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            setattr(message, name, draw(FLOATS))
    for name in ("top_k", "max_tokens", "logprobs"):
        if draw(st.booleans()):
            setattr(message, name, draw(INT32))
    if draw(st.booleans()):
        message.seed = draw(st.integers(0, 2**64 - 1))
    message.min_tokens = draw(st.one_of(st.just(0), INT32))
    message.stop.extend(draw(st.lists(TEXT, max_size=20)))
    message.stop_token_ids.extend(draw(st.lists(INT32, max_size=70)))
    message.ignore_eos = draw(st.booleans())
    return message


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=draw(st.one_of(TEXT, st.just("r" * 200))))
    kind = draw(st.sampled_from(["text", "messages", "token_ids", "none"]))
    if kind == "text":
        request.text = draw(TEXT)
    elif kind == "messages":
        messages = draw(st.lists(st.tuples(TEXT, TEXT), max_size=6))
        request.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    elif kind == "token_ids":
        ids = draw(
            st.one_of(st.lists(INT32, max_size=8), st.lists(st.integers(0, 600), max_size=80))
        )
        request.token_ids.ids.extend(ids)
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling()))
    return request


@pytest.fixture
def tiny_short(smollm2_tokenizer: Any) -> Any:
    return tiny_model(
        "llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer, context=64
    )


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(batch=st.lists(requests(), min_size=5, max_size=12))
async def test_fuzz_generate_requests_never_end_internal(
    tiny_short: Any, batch: list[pb.GenerateRequest]
) -> None:
    expected = reference_tokens(tiny_short.model, [5, 6, 7], 8)
    async with serving(tiny_short, output_buffer_size=4) as (server, port):
        with trio.fail_after(120):
            statuses = []
            for request in batch:
                try:
                    await in_asyncio(generate, port, request)
                    statuses.append(Status.OK)
                except GRPCError as exc:
                    statuses.append(exc.status)
            assert set(statuses) <= ALLOWED, list(zip(statuses, batch, strict=True))
            assert token_ids(await in_asyncio(generate, port, greedy([5, 6, 7], 8))) == expected
            await wait_all_blocks_free(port)
            assert server.engine.state is EngineState.SERVING
