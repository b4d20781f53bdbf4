"""Prefix caching through the gRPC server: usage and stats report hits, and a cache_salt keeps
tenants apart."""

from __future__ import annotations

import pytest
import trio
from grpclib import GRPCError, Status

from loom.core.config import CacheConfig
from loom.model.loader import LoadedModel
from loom.v1 import loom_pb2 as pb
from tests.support.grpc_client import (
    generate,
    greedy,
    in_asyncio,
    server_stats,
    wait_all_blocks_free,
)
from tests.support.server_harness import serving

PROMPT = list(range(10, 60))  # 50 tokens: 3 full blocks of 16


def salted(salt: str) -> pb.GenerateRequest:
    request = greedy(PROMPT, 4)
    request.cache_salt = salt
    return request


async def cached_tokens(port: int, request: pb.GenerateRequest) -> int:
    responses = await in_asyncio(generate, port, request)
    return int(responses[-1].final.usage.cached_tokens)


async def test_server_reports_hits_and_different_salts_share_no_block(
    tiny_chat: LoadedModel,
) -> None:
    async with serving(tiny_chat, cache=CacheConfig(block_size=16)) as (_, port):
        with trio.fail_after(60):
            assert await cached_tokens(port, salted("")) == 0
            assert await cached_tokens(port, salted("")) == 48
            assert await cached_tokens(port, salted("tenant-a")) == 0
            assert await cached_tokens(port, salted("tenant-b")) == 0
            assert await cached_tokens(port, salted("tenant-a")) == 48
            stats = await wait_all_blocks_free(port)
            assert stats.prefix_cache_hits == 96
            assert stats.prefix_cache_queries == 5 * len(PROMPT)
            # Three salts (none, a, b), each with its own 3 prompt blocks (and the output's).
            assert stats.num_cached_blocks >= 9


async def test_server_refuses_an_oversized_cache_salt_by_name(tiny_chat: LoadedModel) -> None:
    async with serving(tiny_chat) as (_, port):
        with trio.fail_after(30):
            with pytest.raises(
                GRPCError, match="cache_salt has 257 characters; the limit is 256"
            ) as info:
                await in_asyncio(generate, port, salted("x" * 257))
            assert info.value.status is Status.INVALID_ARGUMENT
            assert (await in_asyncio(server_stats, port)).num_free_blocks > 0


async def test_server_without_prefix_caching_reports_no_hits(tiny_chat: LoadedModel) -> None:
    config = CacheConfig(block_size=16, enable_prefix_caching=False)
    async with serving(tiny_chat, cache=config) as (_, port):
        with trio.fail_after(60):
            assert [await cached_tokens(port, salted("")) for _ in range(2)] == [0, 0]
            stats = await wait_all_blocks_free(port)
            assert (stats.prefix_cache_hits, stats.num_cached_blocks) == (0, 0)
