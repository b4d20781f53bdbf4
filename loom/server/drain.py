"""The drain SIGTERM starts: one object, one phase at a time, each step bounded by the drain
deadline (`drain_timeout` after the signal).

    t = 0           ANNOUNCED  health NOT_SERVING; the port closes (handshakes stopped, its
                               listen backlog taken, then closed); idle connections are sent
                               a PING and a GOAWAY that lets every stream through, in one
                               write, and so are a gateway's (SMG's), busy or not; a proxy's
                               busy connection gets that GOAWAY right after its last
                               stream. Calls still arriving are served: their clients sent
                               them before they heard.
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
is told while busy; the others are left to close when their clients are done. A gateway
that speaks the vLLM engine protocol (SMG, over hyper) keeps one connection busy with many
streams; its client runs them on after a GOAWAY and opens a new connection for new calls, which
the closed port refuses: it sends them to another replica.

Each phase's meaning for a connection is in the fronts (`Endpoint.enter`, with
`Connection.announce_drain` and `Connection.refuse_new_calls`; `HttpFront.enter`); its
timing is here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from loom.server.io_thread import Io
from loom.server.traffic import DrainPhase

log = logging.getLogger(__name__)
GRACE = 0.25  # at least this long between the announcement and refusing (RFC 9113 §6.8)
HEARD_WAIT = 5.0  # at most this long for the peers to hear, then for the calls to arrive


class Drain:
    """The drain's timing, and its phase: entered here, and nowhere else."""

    def __init__(self, io: Io, drain_engine: Callable[[], None], timeout: float) -> None:
        self.io = io
        self.drain_engine = drain_engine  # the engine takes no more requests
        self.timeout = timeout
        self.phase = DrainPhase.SERVING  # the trio side's view; the ledger's follows it
        self.deadline: float | None = None
        self.done = trio.Event()

    async def run(self, engine_done: trio.Event, engine_scope: trio.CancelScope) -> None:
        """The whole drain; `done` is set at its end, whatever happened."""
        start = trio.current_time()
        self.deadline = deadline = start + self.timeout
        io, traffic = self.io, self.io.traffic
        try:
            await self.enter(DrainPhase.ANNOUNCED, min(start + HEARD_WAIT, deadline))
            await trio.sleep_until(min(start + GRACE, deadline))
            await self.enter(DrainPhase.REFUSING, min(trio.current_time() + HEARD_WAIT, deadline))
            self.drain_engine()
            with trio.move_on_at(deadline):
                await engine_done.wait()
            if not engine_done.is_set():
                log.warning("drain timeout: ending the requests still running")
                engine_scope.cancel()
                await engine_done.wait()
            with trio.move_on_at(deadline):
                await io.until_zero(traffic.in_flight)
                if io.num_connections:
                    log.info("waiting for %d connections to close", io.num_connections)
                await io.until_zero(traffic.connections)
            self.phase = DrainPhase.CLOSED
        finally:
            self.done.set()

    async def enter(self, phase: DrainPhase, until: float) -> None:
        """Every front enters `phase`, then the wait for what it waits on (or `until`): that
        every peer told has heard, after the announcement; that every request admitted has
        reached the engine, once refusing."""
        self.phase = phase
        if phase is DrainPhase.ANNOUNCED:
            self.io.set_serving(False)
        count = (
            self.io.traffic.unheard if phase is DrainPhase.ANNOUNCED else self.io.traffic.arriving
        )
        if self.io.enter(phase):
            with trio.move_on_at(until):
                await self.io.until_zero(count)
