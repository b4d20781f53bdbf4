"""Speculative decoding through both APIs (a tiny random Llama over SmolLM2's tokenizer, n-gram
drafts): greedy tokens equal transformers' `generate`, with drafts and without (the per-request
switch: loom.v1's `speculative`, the OpenAI body's `speculative`); a streamed answer's text is
the whole answer's; a switch that is not a boolean is refused naming it; a tenant sees its own
draft figures; vLLM's protocol reports a request's drafts.

Rules: loopback only, port 0, a timeout on every I/O test; real server, real clients.
"""

from __future__ import annotations

import json
from typing import Any

import trio

from loom.core.config import SchedulerConfig
from loom.core.speculative import SpeculativeConfig
from loom.model.loader import LoadedModel
from loom.server.openai.config import HttpConfig
from loom.server.tenants import TenantConfig
from loom.smg import vllm_engine_pb2 as vllm_pb
from loom.v1 import loom_pb2 as pb
from tests.server.test_tenants import generate as generate_as
from tests.server.test_tenants import stats
from tests.server.vllm.test_vllm_servicer import vllm_generate
from tests.support.greedy import reference_tokens
from tests.support.grpc_client import (
    bearer,
    generate,
    greedy,
    in_asyncio,
    token_ids,
    wait_all_blocks_free,
)
from tests.support.http_client import openai_client, post
from tests.support.server_harness import serving

NGRAM = SchedulerConfig(
    speculative=SpeculativeConfig(
        speculative_method="ngram", prompt_lookup_min=1, prompt_lookup_max=3
    )
)
REPEATING = [3, 1, 4, 1, 5, 9, 2, 6] * 4


async def test_grpc_greedy_tokens_with_drafts_equal_generate_and_those_without(
    tiny_chat: LoadedModel,
) -> None:
    expected = reference_tokens(tiny_chat.model, REPEATING, 40)
    async with serving(tiny_chat, scheduler=NGRAM) as (server, port):
        with trio.fail_after(60):
            drafted = await in_asyncio(generate, port, greedy(REPEATING, 40))
            plain = await in_asyncio(generate, port, greedy(REPEATING, 40, speculative=False))
            spec = server.engine.stats().spec_decode
            assert spec is not None
            assert spec.num_accepted_tokens > 0
            num_drafted = spec.num_draft_tokens
            assert token_ids(drafted) == token_ids(plain) == expected
            # The switched-off request drafted nothing, and a step's tokens come in one delta.
            assert await in_asyncio(generate, port, greedy(REPEATING, 40, speculative=False))
            assert server.engine.stats().spec_decode.num_draft_tokens == num_drafted  # type: ignore[union-attr]
            assert len(drafted) < len(plain)
            await wait_all_blocks_free(port)


async def test_http_greedy_text_with_drafts_equals_the_text_without(tiny_chat: LoadedModel) -> None:
    async with serving(tiny_chat, scheduler=NGRAM, http=HttpConfig(http_port=0)) as (server, _):
        client = openai_client(server.http_port or 0)

        def ask(**extra: Any) -> tuple[str, str]:
            common: dict[str, Any] = {"model": "tiny-llama", "prompt": REPEATING, "max_tokens": 60}
            whole = client.completions.create(temperature=0, extra_body=extra, **common)
            stream = client.completions.create(
                temperature=0, stream=True, extra_body=extra, **common
            )
            return whole.choices[0].text, "".join(c.choices[0].text for c in stream)

        with trio.fail_after(60):
            drafted, drafted_streamed = await trio.to_thread.run_sync(ask)
            plain, plain_streamed = await trio.to_thread.run_sync(lambda: ask(speculative=False))
        assert drafted == drafted_streamed == plain == plain_streamed != ""
        spec = server.engine.stats().spec_decode
        assert spec is not None
        assert spec.num_accepted_tokens > 0


async def test_http_refuses_a_speculative_switch_that_is_not_a_boolean(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat, scheduler=NGRAM, http=HttpConfig(http_port=0)) as (server, _):
        body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2, "speculative": "no"}
        with trio.fail_after(30):
            status, _, data = await post(server.http_port or 0, "/v1/completions", body)
        assert status == 400
        assert json.loads(data)["error"]["param"] == "speculative"
        assert pb.SamplingParams(speculative=False).HasField("speculative")


async def test_grpc_a_tenant_sees_its_own_draft_figures_an_admin_everyones(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    """Whether another tenant's answers repeat its prompts is its own business: a tenant's
    spec_decode counts its own ended requests; an admin's counts all, by position too."""
    tenants = TenantConfig(api_key_file=key_file)
    async with serving(tiny_chat, scheduler=NGRAM, tenants=tenants) as (_, port):
        with trio.fail_after(60):
            await in_asyncio(generate_as, port, greedy(REPEATING, 40), **bearer("key-of-a"))
            of_a = (await in_asyncio(stats, port, **bearer("key-of-a"))).spec_decode
            of_b = (await in_asyncio(stats, port, **bearer("key-of-b"))).spec_decode
            of_all = (await in_asyncio(stats, port, **bearer("key-of-root"))).spec_decode
    assert of_a.num_accepted_tokens > 0
    assert of_a.num_draft_tokens == of_all.num_draft_tokens
    assert list(of_a.accepted_per_pos) == []  # the positions: every tenant's, an admin's
    assert sum(of_all.accepted_per_pos) == of_all.num_accepted_tokens
    assert (of_b.num_drafts, of_b.num_draft_tokens, of_b.num_accepted_tokens) == (0, 0, 0)


async def test_vllm_protocol_completes_with_its_draft_figures(tiny_chat: LoadedModel) -> None:
    """vLLM's GenerateComplete counts a request's draft tokens and those accepted, as vLLM's
    servicer does: what a gateway in front (SMG) reads of speculative decoding."""
    request = vllm_pb.GenerateRequest(
        request_id="r",
        tokenized=vllm_pb.TokenizedInput(input_ids=REPEATING),
        sampling_params=vllm_pb.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    )
    async with serving(tiny_chat, scheduler=NGRAM) as (_, port):
        with trio.fail_after(60):
            (answer,) = await in_asyncio(vllm_generate, port, request)
    complete = answer.complete
    assert complete.output_ids == reference_tokens(tiny_chat.model, REPEATING, 40)
    assert 0 < complete.spec_accepted_tokens <= complete.spec_draft_tokens
