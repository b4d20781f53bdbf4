"""A kill storm: many grpclib clients that leave at random points, against a running server.

Each client has a connection of its own and does one of: read its stream to the end; cancel
it (RST_STREAM) after a few messages; drop its connection mid-stream; give its call a short
deadline; stop reading (small HTTP/2 windows) and then drop the connection. Some client
processes are killed with SIGKILL mid-stream. Outcomes are counted as `kind: outcome`; from a
healthy server every `read` client ends `ok`, none sees INTERNAL or UNKNOWN, and every block is
free once the storm is over.

    python -m tests.storm --address 127.0.0.1:50051 --clients 1000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.config import Configuration

from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub

SMALL_WINDOWS = Configuration(http2_connection_window_size=65535, http2_stream_window_size=65535)
KINDS = ("read", "cancel", "drop", "deadline", "stop_reading")
KILLED_CLIENT = """
import asyncio, sys
from grpclib.client import Channel
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub

async def main():
    async with Channel(sys.argv[1], int(sys.argv[2])) as channel:
        async with LoomStub(channel).Generate.open() as stream:
            sampling = pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4]), sampling=sampling)
            await stream.send_message(request, end=True)
            async for _ in stream:
                print("token", flush=True)
                await asyncio.sleep(0.05)

asyncio.run(main())
"""


def request(rng: random.Random, vocab_size: int) -> pb.GenerateRequest:
    prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 24))]
    sampling = pb.SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]), max_tokens=rng.randint(1, 48), ignore_eos=True
    )
    if rng.random() < 0.3:
        sampling.logprobs = rng.randint(0, 20)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


async def one_client(host: str, port: int, rng: random.Random, vocab_size: int) -> str:
    """`kind: outcome`, the kind being what the client does."""
    kind = rng.choice(KINDS)
    return f"{kind}: {await behave(kind, host, port, rng, vocab_size)}"


async def behave(kind: str, host: str, port: int, rng: random.Random, vocab_size: int) -> str:
    leave_after = rng.randint(0, 4)  # messages read before leaving
    channel = Channel(host, port, config=SMALL_WINDOWS if kind == "stop_reading" else None)
    try:
        timeout = rng.uniform(0.01, 0.3) if kind == "deadline" else None
        async with LoomStub(channel).Generate.open(timeout=timeout) as stream:
            await stream.send_message(request(rng, vocab_size), end=True)
            received = 0
            async for _ in stream:
                received += 1
                if kind in ("cancel", "drop", "stop_reading") and received > leave_after:
                    return await leave(kind, stream, channel, rng)
        return "ok"
    except GRPCError as exc:
        return exc.status.name
    except TimeoutError:
        return "client deadline"
    except Exception as exc:  # the client's own side of leaving: a reset, a closed stream
        return type(exc).__name__
    finally:
        channel.close()


async def leave(kind: str, stream: Any, channel: Channel, rng: random.Random) -> str:
    if kind == "cancel":
        await stream.cancel()  # RST_STREAM
        return "cancelled"
    if kind == "drop":
        channel.close()  # the connection goes, mid-stream, with no RST
        return "dropped"
    await asyncio.sleep(rng.uniform(0.0, 0.5))  # reads nothing for a while, then goes
    return "stopped reading"


async def storm(
    host: str, port: int, *, num_clients: int, concurrency: int, vocab_size: int, seed: int
) -> Counter[str]:
    """Run `num_clients` clients, `concurrency` at a time; their outcomes, counted."""
    rng = random.Random(seed)
    slots = asyncio.Semaphore(concurrency)
    outcomes = Counter[str]()

    async def run(client_rng: random.Random) -> None:
        async with slots:
            outcomes[await one_client(host, port, client_rng, vocab_size)] += 1

    clients = [run(random.Random(rng.random())) for _ in range(num_clients)]
    killed = asyncio.ensure_future(kill_clients(host, port, count=max(1, num_clients // 50)))
    await asyncio.gather(*clients)
    outcomes["killed process"] += await killed
    return outcomes


async def kill_clients(host: str, port: int, *, count: int) -> int:
    """Client processes SIGKILLed once they have read a token (or after 30 s)."""
    command = [sys.executable, "-c", KILLED_CLIENT, host, str(port)]
    processes = [
        await asyncio.create_subprocess_exec(*command, stdout=subprocess.PIPE) for _ in range(count)
    ]
    for process in processes:
        assert process.stdout is not None
        await asyncio.wait_for(process.stdout.readline(), 30)
        process.send_signal(signal.SIGKILL)
    for process in processes:
        await process.wait()
    return sum(process.returncode == -signal.SIGKILL for process in processes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    host, _, port = args.address.rpartition(":")
    start = time.perf_counter()
    outcomes = asyncio.run(
        storm(
            host,
            int(port),
            num_clients=args.clients,
            concurrency=args.concurrency,
            vocab_size=args.vocab_size,
            seed=args.seed,
        )
    )
    print(f"{args.clients} clients in {time.perf_counter() - start:.1f} s: {dict(outcomes)}")


if __name__ == "__main__":
    main()
