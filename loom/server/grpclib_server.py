"""grpclib's Server, with what Loom needs of it that grpclib keeps private.

With loom/server/drain.py and loom/server/calls.py, the one place that touches grpclib's
internals (`Server._server`, `Server._protocol_factory`, `Handler.accept`, `Handler._tasks`,
`Connection._connection`, `EventsProcessor.processors`, `Stream._stream`, the transport
grpclib writes to, and h2's `_prepare_for_sending`, `open_inbound_streams` and
`remote_settings`): the bound port; closing the listening socket while open connections carry
on, after taking its backlog; the open connections, counted (drain waits on them), told how
many streams each may open (HTTP/2 MAX_CONCURRENT_STREAMS), told to go away in a drain,
closed when idle once new calls are refused, and closed at shutdown (grpclib's `close()`
cancels the calls but leaves the sockets to the garbage collector); each call admitted or
refused in a drain as its stream opens; a request message refused by its size before its
body is read, on every service, and malformed frames and grpc-timeout headers answered
INVALID_ARGUMENT (loom/server/calls.py); and the client's deadline taken out of grpclib's
hands (grpclib answers a deadline that passes before the handler starts with UNKNOWN,
"Internal Server Error"; the servicer and the engine answer DEADLINE_EXCEEDED). Everything
here runs in the server's asyncio thread.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any, cast

from grpclib.metadata import Deadline
from grpclib.protocol import H2Protocol
from grpclib.server import Handler, Server
from h2.connection import ConnectionInputs, H2Connection
from h2.settings import SettingCodes
from hyperframe.frame import SettingsFrame

from loom.server.bridge import Count
from loom.server.calls import MALFORMED, capped
from loom.server.drain import (
    DrainingTransport,
    admit,
    drain_ping,
    graceful_goaway,
    hear_ping_answers,
    pending_connections,
)

log = logging.getLogger(__name__)


class TrackedProtocol(asyncio.Protocol):
    """An H2Protocol that counts itself in its server's open connections while connected."""

    def __init__(self, inner: H2Protocol, server: GrpclibServer) -> None:
        self.inner = inner
        self.server = server
        self.transport: asyncio.BaseTransport | None = None
        self.writer: DrainingTransport | None = None  # what grpclib writes to
        self.unheard = False  # told to go away; has neither answered the PING with it nor closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.server.connecting.discard(self)
        self.server.connections.add(self)
        self.server.num_connections.add(1)
        self.writer = DrainingTransport(
            cast(asyncio.Transport, transport),
            lambda: self.inner.connection._connection,
            lambda: self.server.draining,
        )
        self.inner.connection_made(self.writer)
        hear_ping_answers(self.inner.processor, self.heard)
        advertise_stream_limit(
            self.inner.connection._connection, self.server.max_streams_per_connection
        )
        self.inner.connection.flush()
        if self.server.draining:  # accepted as the drain began, or from the listen backlog
            self.announce_drain()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)
        self.server.connections.discard(self)
        self.server.num_connections.add(-1)
        self.heard()

    @property
    def idle(self) -> bool:
        """Connected, with no stream open."""
        connection = getattr(self.inner, "connection", None)  # set once connected
        return connection is not None and connection._connection.open_inbound_streams == 0

    def announce_drain(self) -> None:
        """An idle connection is told to go away at once, a PING just before; a busy one
        after its last stream (see loom/server/drain.py); one not yet connected once it is
        (waited for from now)."""
        if self.writer is None:
            self.expect_answer()
            return
        self.writer.had_stream = not self.idle
        if not self.writer.had_stream:
            self.writer.inner.write(drain_ping() + graceful_goaway())
            self.expect_answer()

    def expect_answer(self) -> None:
        if not self.unheard:
            self.unheard = True
            self.server.unheard.add(1)

    def heard(self) -> None:
        """The peer answered the PING sent with the GOAWAY (every call it sent before it read
        them has arrived, and is open), or the connection closed."""
        if self.unheard:
            self.unheard = False
            self.server.unheard.add(-1)

    def go_away(self) -> None:
        """GOAWAY (no new streams here), then close."""
        self.inner.connection._connection.close_connection()
        self.inner.connection.flush()
        if self.transport is not None:
            self.transport.close()


def advertise_stream_limit(connection: H2Connection, limit: int) -> None:
    """Tell the client it may open `limit` streams at once, in a SETTINGS frame of its own,
    without h2 enforcing it below its default (100). h2 applies every pending change at the
    client's first SETTINGS ACK, so a client that has acknowledged grpclib's first frame but
    not yet read this one would be held to a limit it has not heard, and h2 answers a stream
    over its limit by dropping the connection, with every stream on it. The servicer refuses
    the streams over `limit` one by one."""
    if limit > connection.local_settings.max_concurrent_streams:
        connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: limit})  # only laxer
        return
    frame = SettingsFrame(0)
    frame.settings = {SettingCodes.MAX_CONCURRENT_STREAMS: limit}
    connection.state_machine.process_input(ConnectionInputs.SEND_SETTINGS)
    connection._prepare_for_sending([frame])


class LoomHandler(Handler):
    """grpclib's Handler, preparing each call's stream for every service: its deadline
    (grpc-timeout) kept for the servicer and out of grpclib's machinery, and its reads capped
    at `max_request_bytes` (grpclib reads a message whole, whatever the size its header says)."""

    max_request_bytes: int
    server: GrpclibServer

    def accept(self, stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
        try:
            stream.loom_deadline = Deadline.from_headers(headers)
        except ValueError:  # grpclib would drop the connection, and the others' streams on it
            stream.loom_deadline = MALFORMED
        headers = [(name, value) for name, value in headers if name != "grpc-timeout"]
        stream.recv_data = capped(stream.recv_data, self.max_request_bytes)
        super().accept(stream, headers, release_stream)
        path = next((value for name, value in headers if name == ":path"), "")
        admit(stream, path, self._tasks[stream], self.server.refusing, self.server.arriving)


class GrpclibServer(Server):
    def __init__(
        self, handlers: Any, *, max_streams_per_connection: int, max_request_bytes: int
    ) -> None:
        super().__init__(handlers)
        self.max_streams_per_connection = max_streams_per_connection
        self.max_request_bytes = max_request_bytes
        self.connections: set[TrackedProtocol] = set()  # the open ones
        self.connecting: weakref.WeakSet[TrackedProtocol] = weakref.WeakSet()  # not yet open
        self.draining = False
        self.accepting: set[asyncio.Task[Any]] = set()  # backlog connections being set up
        self.num_connections = Count()
        # Connections told to go away that have not yet shown they heard, and those still
        # being taken from the backlog (told once connected): the drain waits for none.
        self.unheard = Count()
        self.refusing = False  # the drain's second phase: calls opened from now on refused
        # Generate calls admitted (opened before that) whose handler has not yet handed them
        # to the engine: the engine stops taking requests once there are none.
        self.arriving = Count()

    def _protocol_factory(self) -> TrackedProtocol:  # type: ignore[override]
        """grpclib's, with a LoomHandler, in a TrackedProtocol."""
        self.__gc_step__()
        handler = LoomHandler(
            self._mapping, self._codec, self._status_details_codec, self.__dispatch__
        )
        handler.max_request_bytes = self.max_request_bytes
        handler.server = self
        self._handlers.add(handler)
        protocol = TrackedProtocol(H2Protocol(handler, self._config, self._h2_config), self)
        self.connecting.add(protocol)
        return protocol

    @property
    def port(self) -> int:
        """The bound port (`start(port=0)` picks one)."""
        listener = self._server
        if not isinstance(listener, asyncio.Server) or not listener.sockets:
            raise RuntimeError("the gRPC server is not listening")
        return int(listener.sockets[0].getsockname()[1])

    def stop_listening(self) -> None:
        """Accept no new connections; open ones carry on. Those the kernel has completed but
        not yet handed over (the listen backlog) are taken first: closing the socket would
        reset them, and a proxy that has sent a call on one takes the reset for a failed call
        rather than a refused connection it may try elsewhere."""
        listener = self._server
        if not isinstance(listener, asyncio.Server) or not listener.sockets:
            return
        loop = asyncio.get_running_loop()
        for sock in listener.sockets:
            for accepted in pending_connections(sock):
                task = loop.create_task(
                    loop.connect_accepted_socket(self._protocol_factory, accepted)
                )
                self.accepting.add(task)
                self.unheard.add(1)
                task.add_done_callback(self.accepted)
        listener.close()

    def announce_drain(self) -> None:
        """The drain's first phase (loom/server/drain.py): accept no new connections, tell the
        idle ones to go away (calls already on their way are still answered), and the others
        once their last stream has ended, if a proxy holds them. Connections still being taken
        from the backlog are told once connected."""
        self.draining = True
        self.stop_listening()
        for protocol in [*self.connections, *self.connecting]:
            protocol.announce_drain()

    def accepted(self, task: asyncio.Task[Any]) -> None:
        self.accepting.discard(task)
        self.unheard.add(-1)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a connection from the listen backlog failed: %r", task.exception())

    def refuse_new_calls(self) -> None:
        """The drain's second phase: a call on a stream opened from now on is refused (see
        `admit`), and every connection with no stream open is sent a GOAWAY and closed
        (pooled client channels): a client with streams still being read keeps its connection
        until it closes it, since grpclib's client drops unread messages when it gets a GOAWAY."""
        self.refusing = True
        for protocol in list(self.connections):
            if protocol.idle:
                protocol.go_away()

    def close_connections(self) -> None:
        for protocol in list(self.connections):
            if protocol.transport is not None:
                protocol.transport.close()
