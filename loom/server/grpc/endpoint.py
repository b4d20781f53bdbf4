"""The gRPC endpoint, in the server's asyncio thread: the listener (its caps,
loom/server/listener.py), the connections it accepted, the services their calls go to
(grpclib servables: `__mapping__()` names each method's handler and message types), each
refusal counted by the limit that made it, and what each drain phase (loom/server/drain.py)
means for the connections. The caps and the request budget are the server's, shared with the
HTTP front (loom/server/traffic.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from grpclib import GRPCError, Status
from grpclib.exceptions import StreamTerminatedError
from h2.errors import ErrorCodes

from loom.server.boundary import BoundaryConfig
from loom.server.caps import Seat
from loom.server.grpc.call import Call
from loom.server.grpc.connection import Connection
from loom.server.grpc.frames import GENERATE_PATHS, goaway, refusal_preface
from loom.server.grpc.streams import Dispatch
from loom.server.listener import Listener
from loom.server.traffic import DrainPhase, Traffic

log = logging.getLogger(__name__)


class Endpoint:
    def __init__(
        self,
        services: Iterable[Any],
        config: BoundaryConfig,
        on_refused: Callable[[str], None],
        identify: Callable[[Call], Any],
        traffic: Traffic,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.mapping: dict[str, Any] = {}
        for service in services:
            self.mapping.update(service.__mapping__())
        self.config = config
        self.on_refused = on_refused
        self.traffic = traffic
        self.budget = traffic.budget
        self.caps = traffic.caps
        self.identify = identify  # the call's tenant, or GRPCError(UNAUTHENTICATED)
        self.tls = tls
        self.listener = Listener(self.caps, self.accepted, self.refused, refusal)
        self.dispatch = Dispatch(config, traffic, self.mapping, self.refused, self.admitted)
        self.connections: set[Connection] = set()
        self.setting_up: set[asyncio.Task[Any]] = set()  # accepted, not yet connected
        self.handlers: set[asyncio.Task[None]] = set()  # the calls' tasks, held till done
        traffic.fronts.append(self)

    async def start(self, host: str, port: int) -> int:
        """Listen; the bound port (`port` 0 picks one)."""
        return self.listener.listen(host, port)

    # Connections

    def accepted(self, sock: socket.socket, seat: Seat) -> None:
        """A connection within the caps: its protocol is made on the loop's next turns. In a
        drain, it counts as unheard until connected (then told, like the others)."""
        loop = asyncio.get_running_loop()
        connect = loop.connect_accepted_socket(
            partial(self.connection, seat),
            sock,
            ssl=self.tls,
            ssl_handshake_timeout=self.config.preface_timeout if self.tls else None,
            ssl_shutdown_timeout=self.config.write_timeout if self.tls else None,
        )
        task = loop.create_task(connect)
        self.setting_up.add(task)

        def done(task: asyncio.Task[Any]) -> None:
            self.setting_up.discard(task)
            if task.cancelled() or task.exception() is not None:
                # A TLS handshake that failed or never came (a plaintext client, a scanner).
                why = None if task.cancelled() else task.exception()
                log.debug("a connection from %s failed to start: %r", seat.host, why)
                self.refused("tls_handshake" if self.tls else "connection_setup")
                seat.release()
                if task.cancelled():
                    sock.close()  # (else asyncio closed its transport, and the socket with it)

        task.add_done_callback(done)
        if self.traffic.phase is not DrainPhase.SERVING:
            self.wait_for_setup(task)

    def connection(self, seat: Seat) -> Connection:
        def connected() -> None:
            self.connected(connection)

        def disconnected() -> None:
            self.disconnected(connection)

        connection = Connection(self.dispatch, seat, connected, disconnected)
        return connection

    def wait_for_setup(self, task: asyncio.Task[Any]) -> None:
        unheard = self.traffic.unheard
        unheard.add(1)
        task.add_done_callback(lambda _: unheard.add(-1))

    def connected(self, connection: Connection) -> None:
        self.connections.add(connection)
        self.traffic.connections.add(1)
        connection.seat.evict = partial(self.make_room, connection)
        connection.seat.idle()
        if self.traffic.phase is DrainPhase.ANNOUNCED:
            connection.announce_drain()
        elif self.traffic.refusing:
            connection.refuse_new_calls()

    def make_room(self, connection: Connection) -> None:
        """An idle connection gives its place to a new one (the caps are full)."""
        self.refused("made_room")
        connection.close("closed to make room for a new connection", error_code=ErrorCodes.NO_ERROR)

    def disconnected(self, connection: Connection) -> None:
        if connection in self.connections:
            self.connections.remove(connection)
            self.traffic.connections.add(-1)
            connection.seat.release()

    def refused(self, cause: str) -> None:
        self.on_refused(cause)

    # Calls

    def admitted(self, call: Call) -> None:
        """A call admitted on one of the connections: its handler begins. A Generate call is
        counted as arriving until its handler has handed it to the engine (`Call.arrived`) or
        it ended (loom/server/drain.py waits for them), and in flight until it ends."""
        if call.path in GENERATE_PATHS:
            arriving, in_flight = self.traffic.arriving, self.traffic.in_flight
            arriving.add(1)
            in_flight.add(1)
            call.on_arrival = lambda: arriving.add(-1)
            call.when_ended(call.arrived)
            call.when_ended(lambda: in_flight.add(-1))
        task = asyncio.get_running_loop().create_task(self.serve(call))
        call.task = task
        self.handlers.add(task)
        task.add_done_callback(self.handlers.discard)

    async def serve(self, call: Call) -> None:
        """Name the call's tenant (refused: its GRPCError), then run its handler; its status
        (OK, its GRPCError's, or UNKNOWN for a bug) ends it, unless the call ended under it."""
        method = call.method
        try:
            try:
                call.tenant = self.identify(call)  # before anything of the call is read
            except GRPCError as exc:
                self.refused(exc.status.name.lower())  # unauthenticated, or bad metadata
                raise
            await method.func(call)
            if not method.cardinality.server_streaming and not call.headers_sent:
                raise GRPCError(Status.UNKNOWN, "Internal Server Error")  # a unary call's reply
            await end_with(call, Status.OK, None)
        except GRPCError as exc:
            await end_with(call, exc.status, exc.message)
        except (StreamTerminatedError, asyncio.CancelledError):
            pass  # the call ended under it (a reset, the connection lost): nothing to send
        except Exception:
            log.exception("the handler of %s failed", method.func.__qualname__)
            await end_with(call, Status.UNKNOWN, "Internal Server Error")
        finally:
            call.release("done")

    # The drain

    def enter(self, phase: DrainPhase) -> None:
        """What a drain phase means here (loom/server/drain.py)."""
        if phase is DrainPhase.ANNOUNCED:
            for task in self.setting_up:
                self.wait_for_setup(task)
            self.stop_listening()
            for connection in list(self.connections):
                connection.announce_drain()
        elif phase is DrainPhase.REFUSING:
            for connection in list(self.connections):
                connection.refuse_new_calls()

    def stop_listening(self) -> None:
        """Accept no new connections (after those in the backlog); open ones carry on."""
        taken = self.listener.close()
        if taken:
            log.info("took %d connections from the listen backlog", taken)

    async def close(self) -> None:
        """Stop: every connection still open is sent GOAWAY and closed, its calls ended."""
        self.listener.close()
        for connection in list(self.connections):
            connection.close("the server stopped", error_code=ErrorCodes.NO_ERROR)
        await asyncio.sleep(0)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
        await asyncio.sleep(0)  # the transports close their sockets on the next loop turn


async def end_with(call: Call, status: Status, message: str | None) -> None:
    if call.ended is None and not call.trailers_sent:
        with contextlib.suppress(StreamTerminatedError):
            await call.send_trailing_metadata(status=status, status_message=message)


def refusal(_cause: str, why: str) -> bytes:
    """What a connection over a cap is told: the server's settings, then GOAWAY naming why."""
    return refusal_preface() + goaway(ErrorCodes.ENHANCE_YOUR_CALM, 0, why)
