"""`loom serve` as a real process: SIGTERM drains, a second signal exits at once, --help.

The model is a tiny random Llama saved with SmolLM2's tokenizer into a folder, so the process
loads it the way it loads any Hugging Face folder.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpclib import GRPCError, Status
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest

from loom.client.channel import SMALL_WINDOWS
from loom.server.drain import GRACE as DRAIN_GRACE
from loom.v1 import loom_pb2 as pb
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, NOT_SERVING, greedy, token_ids

LOOM = [sys.executable, "-m", "loom"]


@pytest.fixture
def server(tiny_folder: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    command = [*LOOM, "serve", "--model", str(tiny_folder), "--port", "0", "--drain-timeout", "20"]
    command += ["--output-buffer-size", "4"]
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True) as process:
        try:
            port = wait_until_serving(process)
            # Keep reading its log, so that a full pipe never blocks the server.
            threading.Thread(target=process.stderr.read, daemon=True).start()  # type: ignore[union-attr]
            yield process, port
        finally:
            process.kill()


def wait_until_serving(process: subprocess.Popen[str]) -> int:
    """The port from the log line `serving on HOST:PORT` (startup fails the test otherwise)."""
    assert process.stderr is not None
    for line in process.stderr:
        if match := re.search(r"serving on [\d.]+:(\d+)", line):
            return int(match.group(1))
    raise AssertionError(f"loom serve exited with {process.wait()} before serving")


async def slow_stream(
    channel: Channel, started: asyncio.Event, num_started: list[int]
) -> list[int]:
    """A slow reader on a channel with small HTTP/2 windows: flow control holds the server
    back, so its request stays in flight in the engine too (each message carries 20
    logprobs; the window holds ~190 tokens' worth, and the rest come at most a few a
    message, 20 ms apart: a second or more, however fast the machine)."""
    responses = []
    async with LoomStub(channel).Generate.open() as stream:
        await stream.send_message(greedy([3, 1, 4], 400, logprobs=20), end=True)
        async for response in stream:
            if not responses:
                num_started.append(1)
                if len(num_started) == 3:
                    started.set()
            responses.append(response)
            await asyncio.sleep(0.02)
    return token_ids(responses)


def test_serve_process_drains_on_sigterm_and_exits_zero(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    process, port = server

    async def scenario() -> tuple[list[list[int]], Status, int, str]:
        started, num_started = asyncio.Event(), []
        async with Channel(HOST, port, config=SMALL_WINDOWS) as channel:
            streams = [
                asyncio.create_task(slow_stream(channel, started, num_started)) for _ in range(3)
            ]
            await asyncio.wait_for(started.wait(), 30)
            await asyncio.sleep(0.3)
            stats = await LoomStub(channel).GetServerStats(pb.GetServerStatsRequest())
            assert stats.num_running + stats.num_paused == 3  # in flight in the engine too
            os.kill(process.pid, signal.SIGTERM)
            await until_refused(port)  # the drain has begun: a new connection is refused
            await asyncio.sleep(DRAIN_GRACE)
            # On the connection still carrying streams: health says so, new calls are refused
            # (once the grace has passed in the server, however late a loaded machine runs it).
            refused = await refused_call(channel)
            health = await HealthStub(channel).Check(HealthCheckRequest())
            results = await asyncio.wait_for(asyncio.gather(*streams), 60)
        return results, refused.status, int(health.status)

    results, refused, health = asyncio.run(scenario())
    assert [len(r) for r in results] == [400, 400, 400]  # in-flight streams completed
    assert refused is Status.UNAVAILABLE
    assert health == NOT_SERVING
    assert process.wait(timeout=30) == 0


async def refused_call(channel: Channel) -> GRPCError:
    """A new call on `channel`, tried until the drain refuses it: during the grace it is
    served (a few tokens), after it refused; within 5 s of the first try."""
    for _ in range(100):
        try:
            await LoomStub(channel).Generate(greedy([1], 4))
        except GRPCError as error:
            return error
        await asyncio.sleep(0.05)
    raise AssertionError("new calls were still served 5 s after the drain's grace")


async def until_refused(port: int) -> None:
    """Probe with fresh connections until one is refused. A probe that connects just before
    the drain begins may be sent the drain's graceful GOAWAY before the server has read its
    call: grpclib's client then closes the connection and drops the call
    (StreamTerminatedError), and the next probe finds the port closed."""
    for _ in range(500):
        try:
            async with Channel(HOST, port) as fresh:
                await HealthStub(fresh).Check(HealthCheckRequest())
        except ConnectionRefusedError:
            return
        except StreamTerminatedError:
            pass
        await asyncio.sleep(0.01)
    raise AssertionError("the port still listens 5 s after SIGTERM")


def test_serve_process_drain_closes_idle_connections_and_exits(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    """A pooled client channel, idle, stays open: the drain sends it a GOAWAY and closes it,
    so the process exits without waiting out its 20 s drain timeout (it used to)."""
    process, port = server

    async def scenario() -> int | None:
        async with Channel(HOST, port) as channel:  # open and idle when the signal comes
            await HealthStub(channel).Check(HealthCheckRequest())
            os.kill(process.pid, signal.SIGTERM)
            for _ in range(100):  # 10 s at most, half the drain timeout
                if process.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            return process.poll()

    assert asyncio.run(scenario()) == 0


def test_serve_process_exits_at_once_on_a_second_signal(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    process, port = server

    async def scenario() -> Status | None:
        async with Channel(HOST, port) as channel, LoomStub(channel).Generate.open() as stream:
            await stream.send_message(greedy([2], 480), end=True)
            await stream.recv_message()
            os.kill(process.pid, signal.SIGTERM)
            await asyncio.sleep(0.3)
            os.kill(process.pid, signal.SIGINT)
            try:
                async for _ in stream:
                    await asyncio.sleep(0.05)  # slower than the drain would allow
            except GRPCError as exc:
                return exc.status
            except (StreamTerminatedError, OSError):
                return None  # the connection went with the process
        return Status.OK

    outcome = asyncio.run(scenario())
    assert outcome is not Status.OK  # the stream did not finish normally
    assert process.wait(timeout=30) == 1
