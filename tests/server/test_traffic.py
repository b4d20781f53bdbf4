"""What both ports share (loom/server/traffic.py): one set of connection caps, idle
connections closed to make room at the cap, one budget for request bytes being received.
Socket-free tests of the caps, then hostile clients against a real server (sim model, in
process, loopback only, port 0, a timeout on every I/O)."""

from __future__ import annotations

import json
import socket
import threading
import time

import trio
from grpclib import GRPCError, Status

from loom.chaos import attacks
from loom.client import frames as raw
from loom.model.sim import SimRunner, load_sim
from loom.server.boundary import BoundaryConfig
from loom.server.caps import ConnectionCaps
from loom.server.openai.config import HttpConfig
from loom.v1 import loom_pb2 as pb
from tests.support.grpc_client import generate, in_asyncio
from tests.support.http_client import HOST, post, read_all
from tests.support.server_harness import serving, until

HTTP = HttpConfig(http_port=0)
SIM = "sim:step_ms=1,seq_ms=0,token_ms=0"
BODY = json.dumps({"prompt": [3, 4, 5], "max_tokens": 2}).encode()


def test_traffic_at_the_cap_an_idle_connection_of_the_peer_holding_most_makes_room() -> None:
    """Victims: the peer with the most connections first (a squatter holding several, or
    opening them as fast as they are taken, evicts its own), then the connection idle the
    longest; never a busy one; each seat released once."""
    caps = ConnectionCaps(BoundaryConfig(max_connections=4, max_connections_per_peer=4))
    evicted: list[str] = []
    seats = {}
    for name, host in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("c1", "c")):
        seat = caps.take(host)
        seat.evict = lambda name=name: evicted.append(name)  # type: ignore[misc]
        seats[name] = seat
    for name in ("b1", "a1", "a2"):
        seats[name].idle()
    seats["c1"].busy()
    assert caps.over_cap("d") is None  # a holds two: its longest idle goes, not b's older one
    assert evicted == ["a1"]
    d = caps.take("d")
    assert caps.over_cap("e") is None  # a and b hold one each: b1 has been idle longest
    assert evicted == ["a1", "b1"]
    e = caps.take("e")
    seats["a2"].busy()
    refusal = caps.over_cap("f")  # a2, c1, d and e are busy
    assert refusal is not None
    assert refusal[0] == "max_connections"
    seats["a1"].release()  # an evicted one closes: its place was given already
    assert caps.num_connections == 4
    for seat in (seats["a1"], seats["b1"], seats["a2"], seats["c1"], d, e, e):
        seat.release()  # once only
    assert caps.num_connections == 0
    assert not caps.per_peer
    assert caps.num_evicting == 0


def test_traffic_a_peer_at_its_own_cap_evicts_no_one() -> None:
    caps = ConnectionCaps(BoundaryConfig(max_connections=2, max_connections_per_peer=1))
    caps.take("a").idle()
    caps.take("b").idle()
    refusal = caps.over_cap("a")
    assert refusal is not None
    assert refusal[0] == "max_connections_per_peer"
    assert len(caps.idle) == 2


class Squatters(threading.Thread):
    """Silent connections from `sources`, `per_source` each, on `ports`, each reopened as soon
    as the server closes it, until `stop` is set."""

    def __init__(self, ports: list[int], sources: list[str], per_source: int) -> None:
        super().__init__(daemon=True)
        self.ports = ports
        self.sources = sources
        self.per_source = per_source
        self.stop = threading.Event()
        self.reopened = 0

    def run(self) -> None:
        wanted = [
            (port, source) for source in self.sources for port in self.ports
        ] * self.per_source
        held: list[socket.socket | None] = [None] * len(wanted)
        while not self.stop.is_set():
            for i, (port, source) in enumerate(wanted):
                sock = held[i]
                if sock is not None and not attacks.gone(sock):
                    continue
                if sock is not None:
                    sock.close()
                    self.reopened += 1
                try:
                    held[i] = raw.connect(HOST, port, source, timeout=1)
                    held[i].setblocking(False)  # type: ignore[union-attr]
                except OSError:
                    held[i] = None
            time.sleep(0.005)
        for sock in held:
            if sock is not None:
                sock.close()


async def test_traffic_silent_connections_at_the_cap_give_way_to_a_client_every_time() -> None:
    """The cap (16) is filled by silent connections from 8 other addresses on both ports,
    reopened as they are closed: a well-behaved client, on a new connection each time, is
    served every time (before: refused, the cap full of connections that carried nothing)."""
    boundary = BoundaryConfig(max_connections=16, max_connections_per_peer=4)
    async with serving(load_sim(SIM), make_runner=SimRunner, http=HTTP, boundary=boundary) as (
        server,
        grpc_port,
    ):
        port = server.http_port or 0
        caps = server.io.traffic.caps
        sources = [f"127.0.0.{2 + i}" for i in range(8)]
        squatters = Squatters([port, grpc_port], sources, 1)
        squatters.start()
        try:
            with trio.fail_after(60):
                await until(lambda: caps.num_connections >= 16, 10)
                full = caps.num_connections
                statuses = []
                for _ in range(20):
                    answer = await post(port, "/v1/completions", json.loads(BODY))
                    statuses.append(answer[0])
        finally:
            squatters.stop.set()
            await trio.to_thread.run_sync(squatters.join)
    print(f"served {statuses.count(200)} of 20; the squatters reopened {squatters.reopened}")
    assert full == 16
    assert statuses == [200] * 20, statuses


async def test_traffic_one_peer_s_connections_on_both_ports_count_against_one_cap() -> None:
    """max_connections_per_peer=3: two gRPC connections and one HTTP connection from an
    address fill it, on either port (before: each port counted its own, 3 + 3)."""
    boundary = BoundaryConfig(max_connections_per_peer=3)
    async with serving(load_sim(SIM), make_runner=SimRunner, http=HTTP, boundary=boundary) as (
        server,
        grpc_port,
    ):
        port = server.http_port or 0
        with trio.fail_after(30):
            held = [raw.connect(HOST, grpc_port, "127.0.0.2") for _ in range(2)]
            held.append(raw.connect(HOST, port, "127.0.0.2"))
            await trio.sleep(0.2)
            over_http = raw.connect(HOST, port, "127.0.0.2")
            over_grpc = raw.connect(HOST, grpc_port, "127.0.0.2")
            http_reply = await trio.to_thread.run_sync(read_all, over_http)
            grpc_reply = await trio.to_thread.run_sync(read_all, over_grpc)
            other = await post(port, "/version", None, {}, "GET")  # from 127.0.0.1
            for sock in (*held, over_http, over_grpc):
                sock.close()
    assert http_reply.startswith(b"HTTP/1.1 503"), http_reply
    assert b"max_connections_per_peer=3" in http_reply
    assert b"max_connections_per_peer=3" in grpc_reply  # its GOAWAY's debug data
    assert other[0] == 200


async def test_traffic_bodies_being_received_share_the_grpc_port_s_budget() -> None:
    """Two HTTP bodies half sent hold 1,000 KiB of a 1 MiB budget: a gRPC request of 200 KB
    is then RESOURCE_EXHAUSTED and an HTTP one 503, both naming the budget; once the bodies'
    connections close, the budget is whole again (before: HTTP bodies were held outside it)."""
    boundary = BoundaryConfig(max_buffered_request_bytes=1 << 20, request_timeout=20)
    big = pb.GenerateRequest(
        text="x" * 200_000, sampling=pb.SamplingParams(max_tokens=1, ignore_eos=True)
    )
    async with serving(load_sim(SIM), make_runner=SimRunner, http=HTTP, boundary=boundary) as (
        server,
        grpc_port,
    ):
        port = server.http_port or 0
        traffic = server.io.traffic
        with trio.fail_after(40):
            holders = []
            for _ in range(2):
                sock = socket.create_connection((HOST, port))
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 600000\r\n\r\n"
                    + b" "
                    * 500
                    * 1024
                )
                holders.append(sock)
            await until(lambda: traffic.budget.taken >= 1000 * 1024, 10)
            try:
                await in_asyncio(generate, grpc_port, big, 10)
                grpc_error = None
            except GRPCError as exc:
                grpc_error = exc
            http = await post(port, "/v1/completions", b" " * 100_000 + BODY)
            for sock in holders:
                sock.close()
            await until(lambda: traffic.budget.taken == 0, 10)
            left = traffic.budget.taken
    assert grpc_error is not None
    assert grpc_error.status is Status.RESOURCE_EXHAUSTED
    assert "max_buffered_request_bytes" in (grpc_error.message or "")
    assert http[0] == 503, http
    assert b"max_buffered_request_bytes" in http[2]
    assert left == 0
