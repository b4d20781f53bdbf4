"""grpclib clients for the tests: each runs on its own asyncio loop in a worker thread.

The server under test runs in the test's trio thread (pytest-trio), its grpclib half on its own
asyncio thread, so a client in a third thread talks to it over real 127.0.0.1 sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
from grpclib.health.v1.health_pb2 import HealthCheckResponse

from loom.client import calls
from loom.v1 import loom_pb2 as pb

T = TypeVar("T")
HOST = "127.0.0.1"


async def in_asyncio(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """Run an asyncio client coroutine in a worker thread, from trio."""
    return await trio.to_thread.run_sync(lambda: run_client(fn, *args, **kwargs))


def bearer(key: str) -> dict[str, str]:
    """A call's metadata presenting an API key."""
    return {"authorization": f"Bearer {key}"}


def run_client(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """`asyncio.run(fn(...))`, and no socket outlives the loop.

    A transport closed with unsent data (a client cut off mid-send, say by the server refusing
    its oversized message) closes its socket only once that data is flushed, on later turns of
    the loop; `asyncio.run` closes the loop after one turn, and the socket leaks (a
    ResourceWarning, whenever it is collected). A TLS connection the client closed waits for
    its peer's close_notify; what is still open once the data is flushed is aborted."""

    async def main() -> T:
        try:
            return await fn(*args, **kwargs)
        finally:
            await transports_flushed()

    return asyncio.run(main())


async def transports_flushed() -> None:
    loop = asyncio.get_running_loop()
    transports = getattr(loop, "_transports", {})  # the selector loop's, by file descriptor
    deadline = loop.time() + 5.0
    while loop.time() < deadline and any(  # noqa: ASYNC110 (no event says "flushed")
        t.is_closing() and t.get_write_buffer_size() for t in list(transports.values())
    ):
        await asyncio.sleep(0.01)
    for transport in list(transports.values()):
        transport.abort()  # a TLS connection still waiting for its peer's close_notify
    await asyncio.sleep(0)  # the transports' sockets close on this turn


async def generate(
    port: int, request: pb.GenerateRequest, grpc_timeout: float | None = None
) -> list[pb.GenerateResponse]:
    return await calls.generate(HOST, port, request, grpc_timeout=grpc_timeout)


async def server_stats(port: int) -> pb.ServerStats:
    return await calls.server_stats(HOST, port)


async def model_info(port: int) -> pb.ModelInfo:
    return await calls.model_info(HOST, port)


async def health(port: int, service: str = "") -> int:
    status = await calls.health(HOST, port, service=service, grpc_timeout=5)
    return int(HealthCheckResponse.ServingStatus.Value(status))


SERVING = int(HealthCheckResponse.SERVING)
NOT_SERVING = int(HealthCheckResponse.NOT_SERVING)


def token_ids(responses: list[pb.GenerateResponse]) -> list[int]:
    ids: list[int] = []
    for response in responses:
        delta = response.delta if response.HasField("delta") else response.final.delta
        ids.extend(delta.token_ids)
    return ids


def greedy(token_ids: list[int], max_tokens: int, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=token_ids),
        sampling=pb.SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=True, **sampling
        ),
    )


async def wait_all_blocks_free(port: int) -> pb.ServerStats:
    while True:
        stats = await in_asyncio(server_stats, port)
        if stats.num_free_blocks == stats.num_total_blocks and not stats.num_running:
            return stats
        await trio.sleep(0.05)


async def wait_running(port: int) -> None:
    while not (await in_asyncio(server_stats, port)).num_running:  # noqa: ASYNC110 (remote state)
        await trio.sleep(0.02)


async def wait_paused(port: int) -> None:
    while not (await in_asyncio(server_stats, port)).num_paused:  # noqa: ASYNC110 (remote state)
        await trio.sleep(0.02)
