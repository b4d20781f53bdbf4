"""Tenants at the server (loom/server/tenants.py): API keys refused or taken, from grpclib and
grpcio clients, before a request is read; `loom-tenant` honoured only from a trusted proxy;
Abort scoped to the caller's tenant; what each tenant's stats show.

Rules: port 0; the server in this process; clients in worker threads; every test under
`fail_after`.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
from grpclib import GRPCError, Status
from grpclib.client import Channel
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest

from loom.client.channel import SMALL_WINDOWS
from loom.model.loader import LoadedModel
from loom.server.tenants import TenantConfig, Tenants
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, bearer, greedy, in_asyncio, token_ids
from tests.support.server_harness import serving

GENERATE = "/loom.v1.Loom/Generate"


async def generate(port: int, request: pb.GenerateRequest, **metadata: str) -> list[int]:
    async with Channel(HOST, port) as channel:
        responses = await LoomStub(channel).Generate(request, metadata=metadata, timeout=20)
        return token_ids(list(responses))


async def stats(port: int, **metadata: str) -> pb.ServerStats:
    async with Channel(HOST, port) as channel:
        stub = LoomStub(channel)
        return await stub.GetServerStats(pb.GetServerStatsRequest(), metadata=metadata)


async def health(port: int, **metadata: str) -> int:
    async with Channel(HOST, port) as channel:
        response = await HealthStub(channel).Check(HealthCheckRequest(), metadata=metadata)
        return int(response.status)


def grpcio_generate(port: int, metadata: tuple[tuple[str, str], ...]) -> Any:
    with grpc.insecure_channel(f"{HOST}:{port}") as channel:
        call = channel.unary_stream(
            GENERATE,
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        return list(call(greedy([1, 2], 4), metadata=metadata, timeout=20))


async def test_tenants_a_missing_or_wrong_key_is_unauthenticated_from_grpclib_and_grpcio(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    async with serving(tiny_chat, tenants=TenantConfig(api_key_file=key_file)) as (_, port):
        with trio.fail_after(30):
            for metadata in ({}, bearer("key-of-c"), {"authorization": "key-of-a"}):
                with pytest.raises(GRPCError) as refused:
                    await in_asyncio(generate, port, greedy([1, 2], 4), **metadata)
                assert refused.value.status is Status.UNAUTHENTICATED
                assert "API key" in (refused.value.message or "")
                with pytest.raises(grpc.RpcError) as refused_io:
                    await trio.to_thread.run_sync(grpcio_generate, port, tuple(metadata.items()))
                code = refused_io.value.code()  # type: ignore[attr-defined]
                assert code is grpc.StatusCode.UNAUTHENTICATED
            assert (
                len(await in_asyncio(generate, port, greedy([1, 2], 4), **bearer("key-of-a"))) == 4
            )
            responses = await trio.to_thread.run_sync(
                grpcio_generate, port, (("authorization", "Bearer key-of-b"),)
            )
            assert responses[-1].HasField("final")
            with pytest.raises(GRPCError) as refused:
                await in_asyncio(stats, port)
            assert refused.value.status is Status.UNAUTHENTICATED
            assert await in_asyncio(health, port) == 1  # SERVING: probes need no key


async def test_tenants_health_needs_a_key_when_auth_health_is_set(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    config = TenantConfig(api_key_file=key_file, auth_health=True)
    async with serving(tiny_chat, tenants=config) as (_, port):
        with trio.fail_after(30):
            with pytest.raises(GRPCError) as refused:
                await in_asyncio(health, port)
            assert refused.value.status is Status.UNAUTHENTICATED
            assert await in_asyncio(health, port, **bearer("key-of-a")) == 1


async def test_tenants_loom_tenant_is_ignored_from_an_untrusted_peer(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(30):
            await in_asyncio(generate, port, greedy([1, 2], 4), **{"loom-tenant": "mallory"})
            seen = await in_asyncio(stats, port, **{"loom-tenant": "mallory"})
            assert set(seen.tenants) == {HOST}  # the peer's address, not the header's word
            assert seen.tenants[HOST].num_prompt_tokens == 2


async def test_tenants_loom_tenant_names_the_tenant_from_a_trusted_proxy(
    tiny_chat: LoadedModel,
) -> None:
    config = TenantConfig(trusted_proxies=("127.0.0.0/8",))
    async with serving(tiny_chat, tenants=config) as (_, port):
        with trio.fail_after(30):
            await in_asyncio(generate, port, greedy([1, 2, 3], 4), **{"loom-tenant": "alice"})
            await in_asyncio(generate, port, greedy([1, 2], 4), **{"loom-tenant": "bob"})
            seen = await in_asyncio(stats, port, **{"loom-tenant": "alice"})
            assert set(seen.tenants) == {"alice"}
            assert seen.num_prompt_tokens == 3  # alice's own, not bob's
            assert seen.tenants["alice"].num_generated_tokens == 4


async def test_tenants_a_long_tenant_name_or_a_priority_out_of_range_is_refused(
    tiny_chat: LoadedModel,
) -> None:
    config = TenantConfig(trusted_proxies=("127.0.0.1",))
    async with serving(tiny_chat, tenants=config) as (_, port):
        with trio.fail_after(30):
            with pytest.raises(GRPCError) as refused:
                await in_asyncio(generate, port, greedy([1], 4), **{"loom-tenant": "x" * 129})
            assert refused.value.status is Status.INVALID_ARGUMENT
            assert "loom-tenant: 129 characters, more than 128" in (refused.value.message or "")
            for priority in (1_000_001, -1_000_001):
                request = greedy([1], 4)
                request.priority = priority
                with pytest.raises(GRPCError) as refused:
                    await in_asyncio(generate, port, request)
                assert refused.value.status is Status.INVALID_ARGUMENT
                assert "priority must be in [-1000000, 1000000]" in (refused.value.message or "")


@pytest.mark.parametrize(
    ("lines", "error"),
    [
        ("", "no keys"),
        ("lonely-key\n", "line 1: a key and its tenant, got 1 words"),
        ("k1 a\nk1 b\n", "line 2: the key is already given to 'a'"),
        ("k1 a weight=0\n", "line 1: weight must be in [0.01, 100]"),
        ("k1 a weight=nan\n", "line 1: weight must be in [0.01, 100]"),
        ("k1 a root\n", "line 1: unknown option 'root'"),
    ],
)
def test_tenants_a_bad_key_file_fails_at_start_naming_the_line(
    tmp_path: Path, lines: str, error: str
) -> None:
    path = tmp_path / "keys"
    path.write_text(lines)
    with pytest.raises(ValueError, match=re.escape(error)):
        Tenants(TenantConfig(api_key_file=str(path)))


async def test_tenants_see_their_own_figures_and_an_admin_sees_all(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    async with serving(tiny_chat, tenants=TenantConfig(api_key_file=key_file)) as (_, port):
        with trio.fail_after(30):
            prompt = list(range(1, 124))  # 123 tokens: a's secret
            await in_asyncio(generate, port, greedy(prompt, 4), **bearer("key-of-a"))
            await in_asyncio(generate, port, greedy([1, 2], 4), **bearer("key-of-b"))
            b_sees = await in_asyncio(stats, port, **bearer("key-of-b"))
            assert set(b_sees.tenants) == {"b"}
            assert b_sees.num_prompt_tokens == 2
            assert b_sees.prefix_cache_queries == 2
            assert b_sees.tenants["b"].weight == 2.0
            admin_sees = await in_asyncio(stats, port, **bearer("key-of-root"))
            assert set(admin_sees.tenants) == {"a", "b"}
            assert admin_sees.tenants["a"].num_prompt_tokens == 123
            assert admin_sees.num_prompt_tokens == 125


async def abort(port: int, request_ids: list[str], **metadata: str) -> int:
    async with Channel(HOST, port) as channel:
        request = pb.AbortRequest(request_ids=request_ids)
        response = await LoomStub(channel).Abort(request, metadata=metadata)
        return response.num_aborted


async def admitted(port: int, tenant: str, **metadata: str) -> None:
    """Until the tenant has a request admitted (no event tells a client)."""
    while not (await stats(port, **metadata)).tenants[tenant].num_prompt_tokens:  # noqa: ASYNC110
        await asyncio.sleep(0.02)


async def abort_as_b_then_a(port: int) -> tuple[Any, ...]:
    """a's job-1, held (unread, its outputs large: the engine pauses it); b aborts job-1, then
    a does (with an unknown id), then a again: each one's count, and how a's stream ended."""
    request = greedy([1, 2, 3], 480, logprobs=20)
    request.request_id = "job-1"
    counts = []
    try:
        async with (
            Channel(HOST, port, config=SMALL_WINDOWS) as channel,
            LoomStub(channel).Generate.open(metadata=bearer("key-of-a")) as stream,
        ):
            await stream.send_message(request, end=True)
            await admitted(port, "a", **bearer("key-of-a"))
            counts.append(await abort(port, ["job-1"], **bearer("key-of-b")))
            await asyncio.sleep(0.2)
            counts.append(await abort(port, ["job-1", "no-such-job"], **bearer("key-of-a")))
            counts.append(await abort(port, ["job-1"], **bearer("key-of-a")))
            async for _ in stream:
                pass
    except GRPCError as exc:
        return (*counts, exc.status)
    return (*counts, Status.OK)


async def test_tenants_abort_reaches_only_the_callers_own_requests(
    tiny_chat: LoadedModel, key_file: str
) -> None:
    async with serving(tiny_chat, tenants=TenantConfig(api_key_file=key_file)) as (_, port):
        with trio.fail_after(60):
            by_b, by_a, again, ended = await in_asyncio(abort_as_b_then_a, port)
            assert (by_b, by_a, again) == (0, 1, 0)  # b cannot abort a's job-1; a's is idempotent
            assert ended is Status.CANCELLED
            with pytest.raises(GRPCError) as refused:
                await in_asyncio(abort, port, ["x"] * 1025, **bearer("key-of-a"))
            assert refused.value.status is Status.INVALID_ARGUMENT
