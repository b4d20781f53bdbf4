"""A kill storm: many grpclib clients that leave at random points, against a running server.

Each client has a connection of its own and does one of (the behaviours of `loom chaos`,
loom/chaos/clients.py): read its stream to the end; cancel it (RST_STREAM) after a few
messages; drop its connection mid-stream, or reset it (TCP RST); give its call a short deadline;
stop reading for a while (small HTTP/2 windows) and then read on. Some client
processes are killed with SIGKILL mid-stream. Outcomes are counted as `kind: outcome`; from a
healthy server every `read` client ends `ok`, none sees INTERNAL or UNKNOWN, and every block is
free once the storm is over.

    python -m tests.support.storm --address 127.0.0.1:50051 --clients 1000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter

from loom.chaos.clients import Behaviour, Target, kill_clients, stream_once
from loom.v1 import loom_pb2 as pb

KINDS = ("read", "cancel", "drop", "reset", "deadline", "stop_reading")


def request(rng: random.Random, vocab_size: int) -> pb.GenerateRequest:
    prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 24))]
    sampling = pb.SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]), max_tokens=rng.randint(1, 48), ignore_eos=True
    )
    if rng.random() < 0.3:
        sampling.logprobs = rng.randint(0, 20)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


async def one_client(target: Target, rng: random.Random) -> str:
    """`kind: outcome`, the kind being what the client does (loom/chaos/clients.py)."""
    kind = rng.choice(KINDS)
    message = request(rng, target.info.vocab_size)
    return f"{kind}: {await stream_once(target, message, behaviour(kind, rng))}"


def behaviour(kind: str, rng: random.Random) -> Behaviour:
    after = rng.randint(0, 4)  # messages read before leaving
    if kind == "deadline":
        return Behaviour(timeout=rng.uniform(0.01, 0.3))
    if kind == "stop_reading":  # reads nothing for a while (small windows), then reads on
        return Behaviour(leave="stop", after=after, stop_for=rng.uniform(0.0, 0.5))
    return Behaviour(leave=None if kind == "read" else kind, after=after)


async def storm(
    host: str, port: int, *, num_clients: int, concurrency: int, vocab_size: int, seed: int
) -> Counter[str]:
    """Run `num_clients` clients, `concurrency` at a time; their outcomes, counted."""
    target = Target(host=host, port=port, info=pb.ModelInfo(vocab_size=vocab_size))
    rng = random.Random(seed)
    slots = asyncio.Semaphore(concurrency)
    outcomes = Counter[str]()

    async def run(client_rng: random.Random) -> None:
        async with slots:
            outcomes[await one_client(target, client_rng)] += 1

    clients = [run(random.Random(rng.random())) for _ in range(num_clients)]
    count = max(1, num_clients // 50)
    killed = asyncio.ensure_future(kill_clients(target, count, max_tokens=400))
    await asyncio.gather(*clients)
    outcomes["killed process"] += await killed
    return outcomes


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
