"""Loom replicas behind nginx (deploy/nginx/nginx.conf), on loopback: streaming, cancels,
killed clients and deadlines reach the replica through the proxy; calls spread over replicas
and a routing key pins them to one.

Rules: replicas are `loom serve --model sim` processes (the step is a sleep, so replicas do not
fight over the 2 cores), nginx runs in the foreground on a free port (tests/support/nginx_front.py),
and each replica is also asked directly (GetServerStats) what it did.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import h2.connection
import h2.events
import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel

from loom.bench.serving import launched_process
from loom.chaos.clients import KILLED_CLIENT
from loom.client.calls import server_stats
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, greedy, run_client
from tests.support.nginx_front import nginx_front, nginx_path

SIM = ["--model", "sim:step_ms=20", "--drain-timeout", "10"]
# CI installs nginx (.ci/run); elsewhere, without it, these tests say so and do not run.
pytestmark = pytest.mark.skipif(nginx_path() is None, reason="nginx is not installed")


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[int, list[int]]]:
    """Two sim replicas behind nginx: nginx's port, and the replicas'."""
    with ExitStack() as stack:
        replicas = [stack.enter_context(launched_process(SIM))[0] for _ in range(2)]
        yield stack.enter_context(nginx_front(replicas)), replicas


def stats(port: int) -> Any:
    return run_client(server_stats, HOST, port)


def finished(port: int) -> int:
    return sum(stats(port).finished.values())


def wait_idle(port: int) -> Any:
    async def idle() -> Any:
        for _ in range(500):
            s = await server_stats(HOST, port)
            if s.num_free_blocks == s.num_total_blocks and not (s.num_running or s.num_waiting):
                return s
            await asyncio.sleep(0.02)
        raise AssertionError(f"replica {port} not idle: {s}")

    return run_client(idle)


def test_nginx_streams_each_token_as_it_is_made(cluster: tuple[int, list[int]]) -> None:
    front, replicas = cluster

    async def first_then_stats() -> tuple[list[int], int]:
        running = []
        async with Channel(HOST, front) as channel, LoomStub(channel).Generate.open() as stream:
            # 120 tokens, 2.4 s at 20 ms a step: at message 20 the replica has 2 s of steps left,
            # however slowly this client's stats calls go on a loaded machine.
            await stream.send_message(greedy([1, 2, 3], 120), end=True)
            count = 0
            async for _ in stream:
                count += 1
                if count in (1, 10, 20):  # the replica is still generating the rest
                    states = [await server_stats(HOST, p) for p in replicas]
                    running.append(sum(s.num_running for s in states))
        return running, count

    running, count = run_client(first_then_stats)
    assert count == 120
    assert running == [1, 1, 1]  # not one lump at the end: each message came as it was made


def test_nginx_cancel_and_a_killed_client_free_the_replica(cluster: tuple[int, list[int]]) -> None:
    front, replicas = cluster
    before = [stats(p).finished.get("aborted", 0) for p in replicas]

    async def cancel_after_two() -> None:
        async with Channel(HOST, front) as channel, LoomStub(channel).Generate.open() as stream:
            await stream.send_message(greedy([4, 5], 400), end=True)
            await stream.recv_message()
            await stream.recv_message()
            await stream.cancel()

    run_client(cancel_after_two)
    command = [sys.executable, "-c", KILLED_CLIENT, HOST, str(front), "400"]
    with subprocess.Popen(command, stdout=subprocess.PIPE) as client:
        assert client.stdout is not None
        assert client.stdout.readline().startswith(b"token")  # mid-stream
        client.send_signal(signal.SIGKILL)
    for port in replicas:
        wait_idle(port)
    after = [stats(p).finished.get("aborted", 0) for p in replicas]
    assert sum(after) - sum(before) == 2  # both ended on their replica, as aborted


def raw_call(port: int, message: Any, headers: list[tuple[str, str]]) -> dict[str, str]:
    """One Generate call over a plain HTTP/2 connection (h2, no gRPC library): no timer of its
    own, so only the server enforces a grpc-timeout sent by hand. The trailers it ended with."""
    body = message.SerializeToString()
    connection = h2.connection.H2Connection()
    with socket.create_connection((HOST, port), timeout=30) as sock:
        connection.initiate_connection()
        request = [(":method", "POST"), (":scheme", "http"), (":authority", f"{HOST}:{port}")]
        request += [(":path", "/loom.v1.Loom/Generate"), ("content-type", "application/grpc")]
        connection.send_headers(1, [*request, ("te", "trailers"), *headers])
        connection.send_data(1, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)
        sock.sendall(connection.data_to_send())
        while True:
            for event in connection.receive_data(sock.recv(65536)):
                if isinstance(event, h2.events.DataReceived):
                    connection.acknowledge_received_data(event.flow_controlled_length, 1)
                if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                    fields = {k.decode(): v.decode() for k, v in event.headers}
                    if "grpc-status" in fields:
                        return fields
            sock.sendall(connection.data_to_send())


def test_nginx_passes_the_deadline_to_the_replica(cluster: tuple[int, list[int]]) -> None:
    front, replicas = cluster
    before = sum(stats(p).finished.get("deadline", 0) for p in replicas)
    trailers = raw_call(front, greedy([6, 7], 400), [("grpc-timeout", "300m")])
    assert trailers["grpc-status"] == str(Status.DEADLINE_EXCEEDED.value), trailers
    for port in replicas:
        wait_idle(port)
    assert sum(stats(p).finished.get("deadline", 0) for p in replicas) == before + 1


def test_nginx_spreads_calls_and_pins_a_routing_key(cluster: tuple[int, list[int]]) -> None:
    front, replicas = cluster

    async def calls(count: int, metadata: dict[str, str] | None) -> None:
        async with Channel(HOST, front) as channel:
            stub = LoomStub(channel)
            await asyncio.gather(
                *(stub.Generate(greedy([i + 1, 2], 8), metadata=metadata) for i in range(count))
            )

    before = [finished(p) for p in replicas]
    run_client(calls, 16, None)
    spread = [finished(p) - b for p, b in zip(replicas, before, strict=True)]
    assert sum(spread) == 16
    assert min(spread) >= 4, spread  # least connections: both replicas took a share
    for key in ("conversation-1", "conversation-2", "conversation-3"):
        before = [finished(p) for p in replicas]
        run_client(calls, 8, {"loom-routing-key": key})
        pinned = sorted(finished(p) - b for p, b in zip(replicas, before, strict=True))
        assert pinned == [0, 8], (key, pinned)  # one replica took them all


async def read_all(front: int, message: Any) -> str:
    """A well-behaved call through nginx: "ok", or how it failed."""
    try:
        async with Channel(HOST, front) as channel:
            await LoomStub(channel).Generate(message, timeout=60)
        return "ok"
    except GRPCError as exc:
        return f"{exc.status.name}: {exc.message}"
    except Exception as exc:  # a connection error: a finding
        return type(exc).__name__


def test_nginx_moves_on_from_a_draining_replica() -> None:
    """SIGTERM to one replica under load: its streams finish, new calls go to the other with no
    error, and it exits 0 within its drain timeout."""
    errors: list[str] = []
    with ExitStack() as stack:
        (a, process), (b, _) = [stack.enter_context(launched_process(SIM)) for _ in range(2)]
        front = stack.enter_context(nginx_front([a, b], errors))

        async def load() -> tuple[list[str], list[str], float]:
            streams = [
                asyncio.ensure_future(read_all(front, greedy([i + 1, 5], 100))) for i in range(8)
            ]
            while not (await server_stats(HOST, a)).num_running:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            new = []
            for i in range(20):  # new calls while it drains
                new.append(await read_all(front, greedy([i + 1, 6], 8)))
            return list(await asyncio.gather(*streams)), new, signalled

        in_flight, new, signalled = run_client(load)
        assert in_flight == ["ok"] * 8
        assert new == ["ok"] * 20
        drain_timeout = float(SIM[SIM.index("--drain-timeout") + 1])
        assert process.wait(timeout=max(0.1, signalled + drain_timeout - time.monotonic())) == 0
    # nginx did try the draining replica, was refused, and moved on. Refused is ECONNREFUSED
    # (111) once the listener is closed, or ECONNRESET (104) for a connect that sat in the
    # listener's backlog when it closed: the kernel resets those. Either is "while connecting".
    refused = [
        e
        for e in errors
        if re.search(r"connect\(\) failed \((111|104):", e)
        and "while connecting to upstream" in e
        and f":{a}" in e
    ]
    assert refused, errors


def test_nginx_fails_fast_past_a_killed_replica() -> None:
    """SIGKILL to one replica mid-stream: its clients get an error at once, the other
    replica's streams go on, and new calls succeed on the survivor."""
    with ExitStack() as stack:
        (a, process), (b, _) = [stack.enter_context(launched_process(SIM)) for _ in range(2)]
        front = stack.enter_context(nginx_front([a, b]))

        async def load() -> tuple[list[str], list[str], int]:
            streams = [
                asyncio.ensure_future(read_all(front, greedy([i + 1, 5], 100))) for i in range(8)
            ]
            while (await server_stats(HOST, a)).num_running < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            on_b = (await server_stats(HOST, b)).num_running
            process.send_signal(signal.SIGKILL)
            ended = await asyncio.wait_for(asyncio.gather(*streams), 30)  # no hang
            new = [await read_all(front, greedy([i + 1, 6], 8)) for i in range(10)]
            return list(ended), new, on_b

        ended, new, on_b = run_client(load)
        assert ended.count("ok") >= on_b  # the survivor's streams, untouched
        # The killed replica's: 502 (UNAVAILABLE) before their first message, else nginx
        # resets the stream.
        errors = [e for e in ended if e != "ok"]
        assert len(errors) >= 2, ended
        assert all(e.startswith("UNAVAILABLE") or e == "StreamTerminatedError" for e in errors)
        assert new == ["ok"] * 10
