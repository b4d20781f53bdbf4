"""Tenant A of the neighbour test (tests/server/test_neighbours.py), a process of its own:
`python -m tests.support.neighbour HOST PORT KEY LONG QUEUED [small-windows]`. It opens LONG streams
of 4,000 tokens on two connections (32 streams each, the server's cap) and QUEUED short ones on
more, reads none of them, prints "sent", and waits for a line on stdin; then it reads every stream
to its end and prints one JSON object: how many ended each way ("ok", or a gRPC status name) and the
tokens the ok ones received."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from typing import Any

from grpclib import GRPCError
from grpclib.client import Channel

from loom.client.channel import SMALL_WINDOWS
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub

STREAMS_PER_CONNECTION = 32
LONG_TOKENS = 4000
SHORT_TOKENS = 8


def request(max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=sampling)


async def held(stub: LoomStub, max_tokens: int, key: str, read: asyncio.Event) -> tuple[str, int]:
    metadata = {"authorization": f"Bearer {key}"}
    try:
        async with stub.Generate.open(metadata=metadata) as stream:
            await stream.send_message(request(max_tokens), end=True)
            await read.wait()
            received = 0
            async for response in stream:
                delta = response.delta if response.HasField("delta") else response.final.delta
                received += len(delta.token_ids)
            return "ok", received
    except GRPCError as exc:
        return exc.status.name, 0


async def main(
    host: str, port: int, key: str, num_long: int, num_queued: int, small_windows: bool
) -> None:
    read = asyncio.Event()
    sizes = [LONG_TOKENS] * num_long + [SHORT_TOKENS] * num_queued
    num_channels = -(-len(sizes) // STREAMS_PER_CONNECTION)
    # With `small_windows`, a stream it does not read stops at 64 KiB, and the server pauses it;
    # grpclib's own windows (4 MiB) take a 4,000-token stream whole, read or not.
    config = SMALL_WINDOWS if small_windows else None
    channels = [Channel(host, port, config=config) for _ in range(num_channels)]
    tasks: list[asyncio.Task[Any]] = []
    for i, size in enumerate(sizes):
        stub = LoomStub(channels[i // STREAMS_PER_CONNECTION])
        tasks.append(asyncio.ensure_future(held(stub, size, key, read)))
        await asyncio.sleep(0)  # in order: the long ones first
    await asyncio.sleep(1.0)  # every request sent (and the long ones admitted)
    print("sent", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    read.set()
    results = await asyncio.gather(*tasks)
    for channel in channels:
        channel.close()
    ended = Counter(how for how, _ in results)
    tokens = Counter(n for how, n in results if how == "ok")
    print(json.dumps({"ended": ended, "tokens": {str(k): v for k, v in tokens.items()}}))


if __name__ == "__main__":
    host, port, key, num_long, num_queued = sys.argv[1:6]
    small = sys.argv[6:] == ["small-windows"]
    asyncio.run(main(host, int(port), key, int(num_long), int(num_queued), small))
