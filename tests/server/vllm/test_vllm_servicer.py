"""vllm.grpc.engine.VllmEngine on Loom's gRPC port (loom/server/vllm/servicer.py), from a grpclib
client generated from the same protos: Generate's framing (streamed chunks then a Complete per
choice, or one Complete each), the same tokens as loom.v1's Generate, matched stops, refusals
by name, Abort scoped to the caller's tenant, the model, server and load reports, and the
tokenizer bundle.

Rules: port 0; the server in this process (a tiny random Llama over SmolLM2's tokenizer);
clients in worker threads; every test under `fail_after`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
import trio
from grpclib import GRPCError, Status
from grpclib.client import Channel
from transformers import AutoTokenizer

from loom.client.channel import SMALL_WINDOWS
from loom.core.config import CacheConfig, SchedulerConfig
from loom.model.loader import LoadedModel
from loom.server.tenants import TenantConfig
from loom.server.vllm import tokenizer_bundle
from loom.server.vllm.config import VllmConfig
from loom.smg import common_pb2 as common
from loom.smg import vllm_engine_pb2 as pb
from loom.smg.vllm_engine_grpc import VllmEngineStub
from loom.v1 import loom_pb2 as v1
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, bearer, greedy, in_asyncio, token_ids
from tests.support.server_harness import serving

PROMPT = [1, 5, 9, 200, 31, 7]


def generate_request(n: int = 1, stream: bool = False, **sampling: Any) -> pb.GenerateRequest:
    params = pb.SamplingParams(temperature=0, max_tokens=6, n=n, ignore_eos=True, **sampling)
    return pb.GenerateRequest(
        request_id="r",
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=params,
        stream=stream,
    )


async def vllm_generate(port: int, request: pb.GenerateRequest, **metadata: str) -> list[Any]:
    async with Channel(HOST, port) as channel:
        return list(await VllmEngineStub(channel).Generate(request, metadata=metadata, timeout=20))


async def loom_tokens(port: int) -> list[int]:
    async with Channel(HOST, port) as channel:
        return token_ids(list(await LoomStub(channel).Generate(greedy(PROMPT, 6), timeout=20)))


async def test_vllm_streams_chunks_then_a_complete_for_each_choice(tiny_chat: LoadedModel) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(30):
            replies = await in_asyncio(vllm_generate, port, generate_request(n=2, stream=True))
            expected = await in_asyncio(loom_tokens, port)
    for index in (0, 1):
        mine = [r for r in replies if getattr(r, r.WhichOneof("response")).index == index]
        chunks = [r.chunk for r in mine[:-1]]
        complete = mine[-1].complete
        assert all(r.WhichOneof("response") == "chunk" for r in mine[:-1])
        assert [t for c in chunks for t in c.token_ids] == expected
        assert all(c.completion_tokens == len(c.token_ids) for c in chunks)  # each chunk's own
        assert list(complete.output_ids) == list(chunks[-1].token_ids)  # the last batch again
        assert (complete.finish_reason, complete.prompt_tokens) == ("length", len(PROMPT))


async def test_vllm_whole_answers_one_complete_per_choice_with_every_token(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(30):
            replies = await in_asyncio(vllm_generate, port, generate_request(n=3))
            expected = await in_asyncio(loom_tokens, port)
    assert [r.WhichOneof("response") for r in replies] == ["complete"] * 3
    assert sorted(r.complete.index for r in replies) == [0, 1, 2]
    for reply in replies:
        assert list(reply.complete.output_ids) == expected
        assert reply.complete.completion_tokens == 6


async def test_vllm_complete_names_the_stop_token_or_string_that_ended_it(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(30):
            first = (await in_asyncio(loom_tokens, port))[2]
            by_token = await in_asyncio(
                vllm_generate, port, generate_request(stop_token_ids=[first])
            )
            text = tiny_chat.tokenizer.decode(await in_asyncio(loom_tokens, port))
            stop = text.strip()[-3:]
            by_string = await in_asyncio(vllm_generate, port, generate_request(stop=[stop]))
    assert by_token[-1].complete.matched_token_id == first
    assert list(by_token[-1].complete.output_ids)[-1] == first
    assert by_token[-1].complete.finish_reason == "stop"
    assert by_string[-1].complete.finish_reason == "stop"
    assert by_string[-1].complete.matched_stop_str == stop


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.sampling_params.logit_bias.__setitem__(5, 101.0), "logit_bias"),
        (lambda r: setattr(r.sampling_params, "structural_tag", "{}"), "structural_tag"),
        (
            lambda r: setattr(r.sampling_params, "truncate_prompt_tokens", 4),
            "truncate_prompt_tokens",
        ),
        (lambda r: setattr(r.sampling_params, "logprobs", -1), "logprobs"),
        (lambda r: setattr(r.sampling_params, "n", 17), "n is 17; the limit is max_choices=16"),
        (lambda r: setattr(r.sampling_params, "top_p", 1.5), "top_p"),
        (lambda r: r.mm_inputs.mm_hashes.append("x"), "mm_inputs"),
        (lambda r: setattr(r, "kv_transfer_params_json", "{}"), "kv_transfer_params_json"),
        (lambda r: setattr(r, "data_parallel_rank", 1), "data_parallel_rank"),
        (lambda r: r.ClearField("tokenized"), "input is required"),
        (lambda r: setattr(r, "request_id", "x" * 1000), "request_id"),
    ],
)
async def test_vllm_refuses_what_it_cannot_do_naming_the_field(
    tiny_chat: LoadedModel, change: Any, field: str
) -> None:
    request = generate_request()
    change(request)
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(30), pytest.raises(GRPCError) as refused:
            await in_asyncio(vllm_generate, port, request)
    assert refused.value.status is Status.INVALID_ARGUMENT
    assert field in (refused.value.message or "")


async def abort_as_b_then_a(port: int) -> tuple[int, Any]:
    """a's "job" streams, held (unread: the engine pauses it); b aborts "job", which must not
    touch a's; then a does: the tokens a had read before its own Abort, and how it ended."""
    request = generate_request(stream=True)
    request.request_id = "job"
    request.sampling_params.max_tokens = 400
    request.sampling_params.logprobs = 20
    read = 0
    try:
        async with (
            Channel(HOST, port, config=SMALL_WINDOWS) as channel,
            VllmEngineStub(channel).Generate.open(metadata=bearer("key-of-a")) as stream,
        ):
            await stream.send_message(request, end=True)
            await stream.recv_message()
            read += 1
            await abort(port, ["job"], "key-of-b")
            await asyncio.sleep(0.3)
            a = (await admin_stats(port)).tenants["a"]
            if not (a.num_running or a.num_waiting or await num_paused(port)):
                return read, Status.UNKNOWN  # b's Abort reached it
            await abort(port, ["job", "unknown"], "key-of-a")
            async for _ in stream:
                read += 1
    except GRPCError as exc:
        return read, exc.status
    return read, Status.OK


async def admin_stats(port: int) -> Any:
    async with Channel(HOST, port) as channel:
        stats = LoomStub(channel).GetServerStats
        return await stats(v1.GetServerStatsRequest(), metadata=bearer("key-of-root"))


async def num_paused(port: int) -> int:
    return int((await admin_stats(port)).num_paused)


async def abort(port: int, request_ids: list[str], key: str) -> None:
    async with Channel(HOST, port) as channel:
        request = pb.AbortRequest(request_ids=request_ids)
        await VllmEngineStub(channel).Abort(request, metadata=bearer(key))


async def test_vllm_abort_reaches_only_the_callers_own_requests(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    async with serving(tiny_chat, tenants=TenantConfig(api_key_file=key_file)) as (_, port):
        with trio.fail_after(60):
            read, ended = await in_asyncio(abort_as_b_then_a, port)
    assert ended is Status.CANCELLED  # a's own Abort; b's left it running
    assert read > 1


async def reports(port: int) -> tuple[Any, Any, Any, Any]:
    async with Channel(HOST, port) as channel:
        stub = VllmEngineStub(channel)
        return (
            await stub.HealthCheck(pb.HealthCheckRequest()),
            await stub.GetModelInfo(pb.GetModelInfoRequest()),
            await stub.GetServerInfo(pb.GetServerInfoRequest()),
            await stub.GetLoads(pb.GetLoadsRequest()),
        )


async def test_vllm_reports_health_model_server_and_load(tiny_chat: LoadedModel) -> None:
    async with serving(tiny_chat, scheduler=SchedulerConfig(max_num_seqs=8)) as (_, port):
        with trio.fail_after(30):
            health, model, server, loads = await in_asyncio(reports, port)
    assert (health.healthy, health.message) == (True, "serving")
    tokenizer = tiny_chat.tokenizer
    assert model.vocab_size == len(tokenizer)
    assert list(model.eos_token_ids) == [tokenizer.eos_token_id]
    assert (model.bos_token_id, model.architectures) == (
        tokenizer.bos_token_id,
        ["LlamaForCausalLM"],
    )
    assert model.tokenizer_path == ""  # the gateway takes it from GetTokenizer
    assert (server.max_num_seqs, server.block_size, server.server_type) == (8, 16, "loom")
    (load,) = loads.loads
    assert (load.max_running_requests, load.num_running_reqs, load.token_usage) == (8, 0, 0.0)
    assert load.max_total_num_tokens > 0


async def get_tokenizer(port: int) -> list[Any]:
    async with Channel(HOST, port) as channel:
        return list(await VllmEngineStub(channel).GetTokenizer(common.GetTokenizerRequest()))


async def test_vllm_tokenizer_bundle_is_a_zip_a_gateway_builds_the_same_tokenizer_from(
    tiny_chat: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Path] = []
    real = tokenizer_bundle.bundle_of

    def counted(folder: Path) -> Any:
        made.append(folder)
        return real(folder)

    monkeypatch.setattr(tokenizer_bundle, "bundle_of", counted)
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(60):
            chunks = await in_asyncio(get_tokenizer, port)
            again = await in_asyncio(get_tokenizer, port)
    data = b"".join(c.data for c in chunks)
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert b"".join(c.data for c in again) == data
    assert made == [tiny_chat.tokenizer_folder]  # made once, from the tokenizer's files
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path)
    assert "tokenizer.json" in names
    assert all("/" not in name for name in names)
    rebuilt = AutoTokenizer.from_pretrained(str(tmp_path))
    chat = [{"role": "user", "content": "Hello, sea!"}]
    original = tiny_chat.tokenizer
    assert rebuilt.apply_chat_template(chat) == original.apply_chat_template(chat)


async def kv_batches(port: int, key: str, until: Any, start: int = 0) -> list[Any]:
    """A's KV event batches until `until(batches)` says enough."""
    batches: list[Any] = []
    request = common.SubscribeKvEventsRequest(start_sequence_number=start)
    async with (
        Channel(HOST, port) as channel,
        VllmEngineStub(channel).SubscribeKvEvents.open(metadata=bearer(key)) as stream,
    ):
        await stream.send_message(request, end=True)
        async for batch in stream:
            batches.append(batch)
            if until(batches):
                await stream.cancel()
                break
    return batches


def events_of(batches: list[Any]) -> list[Any]:
    return [e for b in batches for e in b.events]


def stored_of(batches: list[Any]) -> list[Any]:
    return [e.stored for e in events_of(batches) if e.WhichOneof("data") == "stored"]


async def test_vllm_kv_events_show_a_tenant_its_own_blocks_alone(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    prompt = list(range(100, 140))  # 40 tokens: 2 full blocks of 16, cached once computed
    request = generate_request()
    request.tokenized.input_ids[:] = prompt
    async with serving(tiny_chat, tenants=TenantConfig(api_key_file=key_file)) as (_, port):
        with trio.fail_after(60):
            await in_asyncio(vllm_generate, port, request, **bearer("key-of-a"))
            mine = await in_asyncio(kv_batches, port, "key-of-a", lambda b: len(stored_of(b)) >= 2)
            theirs = await in_asyncio(kv_batches, port, "key-of-b", lambda b: len(b) >= 2)
            admin = await in_asyncio(
                kv_batches, port, "key-of-root", lambda b: len(stored_of(b)) >= 2
            )
    assert mine[0].events[0].WhichOneof("data") == "cleared"  # a snapshot first
    assert (mine[0].sequence_number, mine[0].snapshot.count) == (1, 1)
    first, second = stored_of(mine)[:2]
    assert list(first.blocks[0].token_ids) == prompt[:16]
    assert list(second.blocks[0].token_ids) == prompt[16:32]
    assert not first.HasField("parent_block_hash")
    assert second.parent_block_hash == first.blocks[0].block_hash
    assert first.blocks[0].block_size == 16
    assert stored_of(theirs) == []  # b sees none of a's blocks
    assert theirs[-1].load.load_only  # only its heartbeat
    assert [s.blocks[0].block_hash for s in stored_of(admin)] == [
        first.blocks[0].block_hash,
        second.blocks[0].block_hash,
    ]


async def test_vllm_kv_events_follow_blocks_stored_and_evicted_live(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    """With 4 blocks to hand out, a second 40-token prompt evicts a block the first cached."""
    requests = []
    for first_token in (100, 300):
        request = generate_request()
        request.tokenized.input_ids[:] = list(range(first_token, first_token + 40))
        requests.append(request)

    async def subscribe_then_generate(port: int) -> list[Any]:
        subscription = asyncio.ensure_future(
            kv_batches(
                port,
                "key-of-a",
                lambda b: any(e.WhichOneof("data") == "removed" for e in events_of(b)),
            )
        )
        await asyncio.sleep(0.3)
        for request in requests:
            await vllm_generate(port, request, **bearer("key-of-a"))
        return await asyncio.wait_for(subscription, 20)

    config = {"cache": CacheConfig(num_blocks=5)}
    async with serving(tiny_chat, tenants=TenantConfig(api_key_file=key_file), **config) as (
        _,
        port,
    ):
        with trio.fail_after(60):
            batches = await in_asyncio(subscribe_then_generate, port)
    stored = {s.blocks[0].block_hash for s in stored_of(batches)}
    removed = [
        h
        for e in events_of(batches)
        if e.WhichOneof("data") == "removed"
        for h in e.removed.block_hashes
    ]
    assert removed
    assert set(removed) <= stored  # only blocks it was told of
    assert [b.sequence_number for b in batches if not b.load.load_only] == list(
        range(1, 1 + sum(not b.load.load_only for b in batches))
    )


async def subscriptions(port: int, keys: tuple[str, ...], start: int = 0) -> list[tuple[str, str]]:
    """A subscription for each key in turn, each held open: how each began ("open", or the
    refusal's status and message)."""
    results: list[tuple[str, str]] = []
    request = common.SubscribeKvEventsRequest(start_sequence_number=start)
    async with contextlib.AsyncExitStack() as stack:
        for key in keys:
            channel = await stack.enter_async_context(Channel(HOST, port))
            stream = await stack.enter_async_context(
                VllmEngineStub(channel).SubscribeKvEvents.open(metadata=bearer(key))
            )
            await stream.send_message(request, end=True)
            try:
                await stream.recv_message()  # the snapshot: it is open
                results.append(("open", ""))
            except GRPCError as exc:
                results.append((exc.status.name, exc.message or ""))
            await stack.enter_async_context(cancelling(stream))
    return results


@contextlib.asynccontextmanager
async def cancelling(stream: Any) -> Any:
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            await stream.cancel()


async def test_vllm_kv_subscriptions_are_capped_in_all_and_by_tenant(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    caps = VllmConfig(
        max_kv_subscriptions=3, max_kv_subscriptions_per_tenant=2, kv_subscribe_interval=0
    )
    tenants = TenantConfig(api_key_file=key_file)
    async with serving(tiny_chat, tenants=tenants, vllm=caps) as (_, port):
        with trio.fail_after(60):
            keys = ("key-of-a", "key-of-a", "key-of-a", "key-of-b", "key-of-b")
            results = await in_asyncio(subscriptions, port, keys)
    assert [status for status, _ in results] == [
        "open",
        "open",
        "RESOURCE_EXHAUSTED",  # a's third: its own cap
        "open",  # b is not held back by a
        "RESOURCE_EXHAUSTED",  # b's second: all 3 are open
    ]
    assert "max_kv_subscriptions_per_tenant" in results[2][1]
    assert "the limit is max_kv_subscriptions" in results[4][1]


async def test_vllm_a_tenant_subscribes_at_most_once_an_interval_from_a_cursor_in_range(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    """Each subscription walks the tenant's cached blocks in the engine's thread: a tenant
    that subscribes and drops in a loop is held to one a second."""
    tenants = TenantConfig(api_key_file=key_file)
    async with serving(tiny_chat, tenants=tenants) as (_, port):
        with trio.fail_after(60):
            keys = ("key-of-a", "key-of-a", "key-of-b")
            results = await in_asyncio(subscriptions, port, keys)
            beyond = await in_asyncio(subscriptions, port, ("key-of-root",), 1 << 63)
    assert results[0] == ("open", "")
    assert results[1][0] == "RESOURCE_EXHAUSTED"
    assert "kv_subscribe_interval=1.0s" in results[1][1]
    assert results[2] == ("open", "")  # another tenant's is not held back
    ((status, message),) = beyond
    assert status == "INVALID_ARGUMENT"
    assert "start_sequence_number must be below" in message


async def test_vllm_a_whole_answer_holds_a_bounded_number_of_logprobs(
    tiny_chat: LoadedModel,
) -> None:
    """16 choices of 400 tokens with 20 alternatives each would hold 134,400 log-probabilities
    in the I/O thread until the end: refused once past MAX_WHOLE_LOGPROBS (131,072), naming
    `logprobs`; streamed, the same request is answered."""
    whole = generate_request(n=16, logprobs=20)
    whole.sampling_params.max_tokens = 400
    streamed = generate_request(n=16, stream=True, logprobs=20)
    streamed.sampling_params.max_tokens = 400
    async with serving(tiny_chat, scheduler=SchedulerConfig(max_num_seqs=16)) as (_, port):
        with trio.fail_after(120):
            with pytest.raises(GRPCError) as refused:
                await in_asyncio(vllm_generate, port, whole)
            replies = await in_asyncio(vllm_generate, port, streamed)
    assert refused.value.status is Status.INVALID_ARGUMENT
    assert "logprobs: a whole answer holds at most 131072" in (refused.value.message or "")
    completes = [r.complete for r in replies if r.WhichOneof("response") == "complete"]
    assert len(completes) == 16
