"""The unary calls every client of Loom makes: the server's stats (once, or polled until a
condition holds), its model, its health; and a Generate call read to its end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from loom.client.channel import PLAIN, Client
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub

TIMEOUT = 10.0  # seconds a call may take, unless told


async def server_stats(host: str, port: int, client: Client = PLAIN) -> pb.ServerStats:
    async with client.channel(host, port) as channel:
        return await LoomStub(channel).GetServerStats(pb.GetServerStatsRequest(), timeout=TIMEOUT)


async def model_info(host: str, port: int, client: Client = PLAIN) -> pb.ModelInfo:
    async with client.channel(host, port) as channel:
        return await LoomStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT)


async def health(
    host: str, port: int, client: Client = PLAIN, service: str = "", grpc_timeout: float = TIMEOUT
) -> str:
    """The service's health, by name: SERVING, NOT_SERVING, SERVICE_UNKNOWN ("": the server)."""
    async with client.channel(host, port) as channel:
        request = HealthCheckRequest(service=service)
        response = await HealthStub(channel).Check(request, timeout=grpc_timeout)
        return str(HealthCheckResponse.ServingStatus.Name(response.status))


async def stats_until(
    host: str,
    port: int,
    done: Callable[[pb.ServerStats], object],
    seconds: float,
    client: Client = PLAIN,
) -> pb.ServerStats:
    """Poll GetServerStats until `done(stats)`, at most `seconds`: the last stats (the server
    offers no call that waits for a state; a poll is one short call every 10 ms)."""
    deadline = time.monotonic() + seconds
    while True:
        stats = await server_stats(host, port, client)
        if done(stats) or time.monotonic() >= deadline:
            return stats
        await asyncio.sleep(0.01)


async def generate(
    host: str,
    port: int,
    request: pb.GenerateRequest,
    client: Client = PLAIN,
    grpc_timeout: float | None = None,
) -> list[pb.GenerateResponse]:
    """A Generate call's every response, read to its end (by the deadline `grpc_timeout`)."""
    async with client.channel(host, port) as channel:
        return list(await LoomStub(channel).Generate(request, timeout=grpc_timeout))
