"""The drain SIGTERM starts: one object, one phase at a time, each step bounded by the drain
deadline (`drain_timeout` after the signal).

    t = 0           ANNOUNCED  health NOT_SERVING; the port closes (handshakes stopped, its
                               listen backlog taken, then closed); idle connections are sent
                               a PING and a GOAWAY that lets every stream through, in one
                               write; a proxy's busy connection gets that GOAWAY right
                               after its last stream. Calls still arriving are served:
                               their clients sent them before they heard.
    t = 0.25..5 s   REFUSING   once every connection told has heard (answered the PING, or
                               closed), and `GRACE` has passed: new streams are refused
                               UNAVAILABLE, idle connections sent GOAWAY and closed.
    + 0..5 s        (engine)   once every Generate call admitted before has reached the engine:
                               the engine takes no more requests and finishes those it has (cut
                               short at the deadline: they end UNAVAILABLE).
    then            CLOSED     the handlers have flushed their last messages and the clients
                               closed their connections (or the deadline came): every
                               connection still open is closed, and the process exits 0.

Why so, behind nginx: a draining replica must never be sent a call it will refuse. nginx
retries a gRPC call on the next replica only while it has not sent it (a refused connection),
never once sent (its request body is not buffered), and it reuses a kept-alive connection
unless a GOAWAY has come on it. A peer answers the PING as it reads it, and the GOAWAY right
behind, so its answer comes after every call it sent before it heard (frames keep their order):
however late a loaded machine reads them, nothing it sent in time is refused. grpc-go sends
its PING after the GOAWAY; h2, under grpclib's client, takes any frame after a GOAWAY for a
protocol error, hence before (a peer that reads the two apart and opens a stream between them
may see it refused); h2 also drops its answer when a GOAWAY follows, but grpclib's client then
closes the connection: heard too. grpclib's client drops the messages it has not read when a
GOAWAY comes, so only a proxy's busy connection (a window of 2^30 or more: nginx's is 2^31-1)
is told while busy; the others are left to close when their clients are done.

Each phase's meaning for a connection is in loom/server/boundary/ (`Endpoint.enter`,
`Connection.announce_drain`, `Connection.refuse_new_calls`); its timing is here.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from loom.engine.engine import Engine
    from loom.server.grpc_thread import GrpcThread

log = logging.getLogger(__name__)
GRACE = 0.25  # at least this long between the announcement and refusing (RFC 9113 §6.8)
HEARD_WAIT = 5.0  # at most this long for the peers to hear, then for the calls to arrive


class DrainPhase(enum.Enum):
    SERVING = "serving"
    ANNOUNCED = "announced"
    REFUSING = "refusing"
    CLOSED = "closed"


class Drain:
    def __init__(self, grpc: GrpcThread, engine: Engine, timeout: float) -> None:
        self.grpc = grpc
        self.engine = engine
        self.timeout = timeout
        self.phase = DrainPhase.SERVING  # the trio side's view; the endpoint keeps its own
        self.deadline: float | None = None
        self.done = trio.Event()

    async def run(self, engine_done: trio.Event, engine_scope: trio.CancelScope) -> None:
        """The whole drain; `done` is set at its end, whatever happened."""
        start = trio.current_time()
        self.deadline = deadline = start + self.timeout
        try:
            await self.enter(DrainPhase.ANNOUNCED, "unheard", min(start + HEARD_WAIT, deadline))
            await trio.sleep_until(min(start + GRACE, deadline))
            now = trio.current_time()
            await self.enter(DrainPhase.REFUSING, "arriving", min(now + HEARD_WAIT, deadline))
            self.engine.drain()
            with trio.move_on_at(deadline):
                await engine_done.wait()
            if not engine_done.is_set():
                log.warning("drain timeout: ending the requests still running")
                engine_scope.cancel()
                await engine_done.wait()
            with trio.move_on_at(deadline):
                await self.grpc.until_zero("num_in_flight")
                if self.grpc.num_connections:
                    log.info("waiting for %d connections to close", self.grpc.num_connections)
                await self.grpc.until_zero("num_connections")
            self.phase = DrainPhase.CLOSED
        finally:
            self.done.set()

    async def enter(self, phase: DrainPhase, count: str, until: float) -> None:
        """Enter `phase` at the endpoint, then wait for its count to reach zero (or `until`)."""
        self.phase = phase
        if phase is DrainPhase.ANNOUNCED:
            self.grpc.set_serving(False)
        if self.grpc.enter(phase):
            with trio.move_on_at(until):
                await self.grpc.until_zero(count)
