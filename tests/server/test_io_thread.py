"""The thread that serves both fronts (gRPC and OpenAI's HTTP API) does no work a client
controls past a few milliseconds at a time: a neighbour's stream keeps its pace while a hostile
client makes the server read costly request bodies.

Rules: a real `loom serve` process of the simulated model (its steps sleep: the gaps measured are
the server's own), the hostile client a process of its own (tests/support/hostile_bodies.py), the
neighbour a grpclib client here."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import time

from grpclib.client import Channel

from loom.bench.serving import launched_process
from loom.v1.loom_grpc import LoomStub
from tests.support.grpc_client import HOST, greedy, run_client

SIM = ["--model", "sim:step_ms=5", "--http-port", "0"]
# A dozen bodies of nearly 4 MiB (max_request_bytes) of numbers, their last bytes sent together.
BODIES, MIB = 12, 3.9
RELEASE = 20  # the neighbour's message after which the last bytes are sent


async def neighbour(port: int, attack: subprocess.Popen[str]) -> tuple[float, float]:
    """A stream of 1,000 tokens at 5 ms a step; the hostile bodies' last bytes are sent after
    its RELEASE-th message. Its worst gap between messages before that, and from then to the
    attack's end."""
    arrivals: list[float] = []
    released = math.inf
    async with (
        Channel(HOST, port) as channel,
        LoomStub(channel).Generate.open(timeout=120) as stream,
    ):
        await stream.send_message(greedy([1, 2, 3], 1000), end=True)
        async for _ in stream:
            arrivals.append(time.monotonic())
            if len(arrivals) == RELEASE:
                assert attack.stdin is not None
                attack.stdin.write("go\n")
                attack.stdin.flush()
                released = time.monotonic()
            if attack.poll() is not None and arrivals[-1] > released + 0.5:
                break  # the attack is over: enough
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return max(gaps[: RELEASE - 1]), max(gaps[RELEASE - 1 :])  # from the RELEASE-th message on


def test_io_thread_large_bodies_leave_a_neighbour_s_stream_at_its_pace() -> None:
    """Twelve 4 MiB bodies of numbers whose last bytes arrive together: the neighbour's
    worst gap between messages stays under 100 ms (json.loads of them on the I/O thread
    stalled every client 6.2 s); each body is read and refused (its prompt is past the
    context), none lost."""
    ports: dict[str, int] = {}
    with launched_process(SIM, ports=ports) as (port, _):
        command = [sys.executable, "-m", "tests.support.hostile_bodies", HOST, str(ports["http"]),
                   str(BODIES), str(MIB)]  # fmt: skip
        with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) as attack:  # fmt: skip
            assert attack.stdout is not None
            assert attack.stdout.readline() == "held\n"
            before, during = run_client(neighbour, port, attack)
            statuses = attack.stdout.read().split("\n")
    print(f"the neighbour's worst gap: {before * 1e3:.1f} ms before, {during * 1e3:.1f} ms during")
    assert [s for s in statuses if s] == ["HTTP/1.1 400 Bad Request"] * BODIES
    assert during < 0.1
