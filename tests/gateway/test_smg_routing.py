"""SMG's routing on what Loom reports: cache-aware routing on Loom's KV events (each group of
requests sharing a long prefix sent where that prefix is cached) against round robin in the
same run, and load-aware routing on Loom's load reports (new requests sent away from a replica
held busy by others).

Rules: replicas are `loom serve --model sim:...,tokenizer=default` processes; the gateway is
the real `smg`; each replica is asked directly (GetServerStats) what it did; prompts are made
new for each measurement, so that no cache holds them before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from openai import OpenAI

from loom.bench.serving import launched_process
from loom.client.calls import server_stats
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, greedy, run_client
from tests.support.smg_front import smg_front

MODEL = "sim"
SIM = [
    *("--model", "sim:step_ms=2,tokenizer=default", "--served-model-name", MODEL),
    *("--http-port", "0", "--max-num-seqs", "8"),
]
NUM_GROUPS = 4
PER_GROUP = 4
PREFIX_WORDS = 80  # about 540 tokens (SmolLM2's tokenizer): at least 512


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[list[int], list[int]]]:
    """Two replicas: their gRPC ports, and their HTTP ports."""
    with ExitStack() as stack:
        grpc_ports, http_ports = [], []
        for _ in range(2):
            ports: dict[str, int] = {}
            grpc_ports.append(stack.enter_context(launched_process(SIM, ports=ports))[0])
            http_ports.append(ports["http"])
        yield grpc_ports, http_ports


def grpc_urls(replicas: list[int]) -> list[str]:
    return [f"grpc://{HOST}:{port}" for port in replicas]


def stats(port: int) -> Any:
    return run_client(server_stats, HOST, port)


def hits(replicas: list[int]) -> list[int]:
    return [stats(port).prefix_cache_hits for port in replicas]


def workload(seed: int) -> list[str]:
    """NUM_GROUPS groups of PER_GROUP prompts, each group's sharing its long prefix, in an
    order of the seed's (in rounds, each group's i-th every NUM_GROUPS requests, round robin
    over two replicas would send each group to one of them every time)."""
    rng = random.Random(seed)
    prefixes = [
        " ".join(f"{rng.choice('abcdefgh')}{rng.randrange(10**6)}" for _ in range(PREFIX_WORDS))
        for _ in range(NUM_GROUPS)
    ]
    prompts = [f"{prefix} Question {i}: why?" for i in range(PER_GROUP) for prefix in prefixes]
    rng.shuffle(prompts)
    return prompts


def send_all(url: str, prompts: list[str], pause: float = 0.0) -> None:
    """Each prompt in turn, `pause` seconds after the answer before the next."""
    with OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30) as client:
        for prompt in prompts:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            time.sleep(pause)


def hits_of(replicas: list[int], url: str, prompts: list[str]) -> list[int]:
    """Each replica's prefix-cache hits (tokens) while `prompts` go to `url`, in order, 0.1 s
    apart (the gateway reads a replica's KV events as they come: on a loaded machine, a
    request sent at once after the last could be routed before them)."""
    before = hits(replicas)
    send_all(url, prompts, pause=0.1)
    time.sleep(0.2)
    return [after - then for after, then in zip(hits(replicas), before, strict=True)]


def test_smg_sends_each_prefix_where_loom_reports_it_cached(
    cluster: tuple[list[int], list[int]],
) -> None:
    replicas, http_ports = cluster
    direct = f"http://{HOST}:{http_ports[0]}"
    possible = sum(hits_of(replicas, direct, workload(1)))  # one cache holds every prefix
    with smg_front(grpc_urls(replicas), "--policy", "cache_aware") as gateway:
        routed = hits_of(replicas, gateway.url, workload(2))
        on_events = gateway.log().count('branch="event_hit"')  # SMG's index of Loom's events
    assert on_events == NUM_GROUPS * (PER_GROUP - 1)
    with smg_front(grpc_urls(replicas), "--policy", "round_robin") as gateway:
        round_robin = sum(hits_of(replicas, gateway.url, workload(3)))
    print(
        f"prefix-cache hits: possible {possible}, cache-aware {routed}, round robin {round_robin}"
    )
    assert sum(routed) >= 0.9 * possible
    assert all(routed)  # the groups spread over both replicas
    assert sum(routed) > round_robin


async def hold_busy(port: int, seconds: float) -> None:
    """Sixteen streams of 4,000 tokens, unread, for `seconds` (their deadline ends them):
    they hold a replica of 8 sequences busy, 8 running, 8 waiting."""

    async def one(channel: Channel) -> None:
        with contextlib.suppress(GRPCError, TimeoutError):  # its deadline, as the client sees it
            await LoomStub(channel).Generate(greedy([1, 2, 3], 4000), timeout=seconds)

    async with Channel(HOST, port) as channel:
        await asyncio.gather(*(one(channel) for _ in range(16)))


def served(port: int) -> int:
    """Requests the replica finished at their max_tokens."""
    return stats(port).finished.get("length", 0)


def until_busy(port: int) -> None:
    for _ in range(300):
        figures = stats(port)
        if (figures.num_running, figures.num_waiting) == (8, 8):
            return
        time.sleep(0.05)
    raise AssertionError(f"the replica is not busy: {figures}")


@pytest.mark.parametrize("policy", ["least_load", "power_of_two"])
def test_smg_sends_new_requests_away_from_a_replica_loom_reports_busy(
    cluster: tuple[list[int], list[int]], policy: str
) -> None:
    replicas, _ = cluster
    holder = threading.Thread(target=run_client, args=(hold_busy, replicas[0], 10.0))
    args = ("--policy", policy, "--load-monitor-interval", "1")
    with smg_front(grpc_urls(replicas), *args) as gateway:
        holder.start()
        try:
            until_busy(replicas[0])
            time.sleep(2.5)  # a load poll or two: 8 running there and 8 queued, none here
            before = [served(port) for port in replicas]
            send_all(gateway.url, [f"Question {i}: why?" for i in range(20)])
            counts = [served(port) - then for port, then in zip(replicas, before, strict=True)]
        finally:
            holder.join(timeout=30)
    print(f"{policy}: served by the busy replica {counts[0]}, by the idle one {counts[1]}")
    assert sum(counts) == 20
    assert counts[1] >= 0.8 * 20


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_smg_drained_replica_finishes_its_streams_while_smg_sends_new_ones_elsewhere(
    policy: str,
) -> None:
    """With cache_aware, SMG also holds a KV event stream open on each replica: the drain
    ends it, so the replica exits once its own streams are done, not at its deadline."""
    args = [*SIM, "--drain-timeout", "20"]
    with ExitStack() as stack:
        launched = [stack.enter_context(launched_process(args, ports={})) for _ in range(2)]
        replicas = [port for port, _ in launched]
        gateway = stack.enter_context(smg_front(grpc_urls(replicas), "--policy", policy))
        client = stack.enter_context(
            OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=60)
        )
        stream = client.completions.create(
            model=MODEL,
            prompt="A long story:",
            max_tokens=1500,  # 3 s at 2 ms a step
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [next(iter(stream))]
        draining = next(i for i, port in enumerate(replicas) if stats(port).num_running)
        other = replicas[1 - draining]
        launched[draining][1].send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        before = served(other)
        send_all(gateway.url, [f"Question {i}: why?" for i in range(10)])
        assert served(other) - before == 10
        chunks += list(stream)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == "length"
        assert chunks[-1].usage.completion_tokens == 1500
        assert launched[draining][1].wait(timeout=30) == 0
        assert time.monotonic() - signalled < 12  # its 3 s stream, not the 20 s deadline
