"""grpclib's Server, with what Loom needs of it that grpclib keeps private.

The one place that touches grpclib's internals (`Server._server`, `Server._protocol_factory`,
`Handler.accept`, `Connection._connection`, `Stream._stream`, the transport grpclib writes to,
and h2's `_prepare_for_sending`, `open_inbound_streams` and `remote_settings`): the bound port;
closing the listening socket while open connections carry on, after taking its backlog; the
open connections, counted (drain waits on them), told how many streams each may open (HTTP/2
MAX_CONCURRENT_STREAMS), told to go away in a drain (loom/server/drain.py), closed when idle
once new calls are refused, and closed at shutdown (grpclib's `close()` cancels the calls but
leaves the sockets to the garbage collector); a request message refused by its size before its
body is read, on every service; malformed frames and grpc-timeout headers answered
INVALID_ARGUMENT; and the client's deadline taken out of grpclib's hands (grpclib answers a
deadline that passes before the handler starts with UNKNOWN, "Internal Server Error"; the
servicer and the engine answer DEADLINE_EXCEEDED). Everything here runs in the server's asyncio
thread.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any, cast

from google.protobuf.message import DecodeError
from grpclib import GRPCError, Status
from grpclib.metadata import Deadline
from grpclib.protocol import H2Protocol
from grpclib.server import Handler, Server, Stream
from h2.connection import ConnectionInputs, H2Connection
from h2.settings import SettingCodes
from hyperframe.frame import SettingsFrame

from loom.server.bridge import Count
from loom.server.drain import DrainingTransport, graceful_goaway, pending_connections

log = logging.getLogger(__name__)


class TrackedProtocol(asyncio.Protocol):
    """An H2Protocol that counts itself in its server's open connections while connected."""

    def __init__(self, inner: H2Protocol, server: GrpclibServer) -> None:
        self.inner = inner
        self.server = server
        self.transport: asyncio.BaseTransport | None = None
        self.writer: DrainingTransport | None = None  # what grpclib writes to

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self.server.num_connections.add(1)
        self.writer = DrainingTransport(
            cast(asyncio.Transport, transport),
            lambda: self.inner.connection._connection,
            lambda: self.server.draining,
        )
        self.inner.connection_made(self.writer)
        advertise_stream_limit(
            self.inner.connection._connection, self.server.max_streams_per_connection
        )
        self.inner.connection.flush()

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

    @property
    def idle(self) -> bool:
        """Connected, with no stream open."""
        connection = getattr(self.inner, "connection", None)  # set once connected
        return connection is not None and connection._connection.open_inbound_streams == 0

    def announce_drain(self) -> None:
        """An idle connection is told to go away at once; a busy one after its last stream
        (see loom/server/drain.py)."""
        if self.writer is None:
            return
        self.writer.had_stream = not self.idle
        if not self.writer.had_stream:
            self.writer.inner.write(graceful_goaway())

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

    def accept(self, stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
        try:
            stream.loom_deadline = Deadline.from_headers(headers)
        except ValueError:  # grpclib would drop the connection, and the others' streams on it
            stream.loom_deadline = MALFORMED
        headers = [(name, value) for name, value in headers if name != "grpc-timeout"]
        stream.recv_data = capped(stream.recv_data, self.max_request_bytes)
        super().accept(stream, headers, release_stream)


MALFORMED = object()


def capped(recv_data: Callable[[int], Awaitable[bytes]], limit: int) -> Callable[..., Any]:
    async def recv(size: int) -> bytes:
        if size > limit:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"the request message has {size} bytes; the limit is max_request_bytes={limit}",
            )
        return await recv_data(size)

    return recv


def deadline_of(stream: Stream[Any, Any]) -> Deadline | None:
    """The client's deadline for a call, if it set one."""
    deadline: Deadline | object | None = getattr(stream._stream, "loom_deadline", None)
    if not (deadline is None or isinstance(deadline, Deadline)):
        raise GRPCError(Status.INVALID_ARGUMENT, "the grpc-timeout header is malformed")
    return deadline


class GrpclibServer(Server):
    def __init__(
        self, handlers: Any, *, max_streams_per_connection: int, max_request_bytes: int
    ) -> None:
        super().__init__(handlers)
        self.max_streams_per_connection = max_streams_per_connection
        self.max_request_bytes = max_request_bytes
        self.connections: set[TrackedProtocol] = set()  # the open ones
        self.draining = False
        self.accepting: set[asyncio.Task[Any]] = set()  # backlog connections being set up
        self.num_connections = Count()

    def _protocol_factory(self) -> TrackedProtocol:  # type: ignore[override]
        """grpclib's, with a LoomHandler, in a TrackedProtocol."""
        self.__gc_step__()
        handler = LoomHandler(
            self._mapping, self._codec, self._status_details_codec, self.__dispatch__
        )
        handler.max_request_bytes = self.max_request_bytes
        self._handlers.add(handler)
        return TrackedProtocol(H2Protocol(handler, self._config, self._h2_config), self)

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
                task.add_done_callback(self.accepted)
        listener.close()

    def announce_drain(self) -> None:
        """The drain's first phase (loom/server/drain.py): accept no new connections, tell the
        idle ones to go away (calls already on their way are still answered), and the others
        once their last stream has ended, if a proxy holds them. Connections still being taken
        from the backlog hear nothing yet: closed when idle at the drain's second phase."""
        self.draining = True
        self.stop_listening()
        for protocol in list(self.connections):
            protocol.announce_drain()

    def accepted(self, task: asyncio.Task[Any]) -> None:
        self.accepting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a connection from the listen backlog failed: %r", task.exception())

    def close_idle_connections(self) -> None:
        """Send GOAWAY on, and close, every connection with no stream open (pooled client
        channels): a client with streams still being read keeps its connection until it closes
        it, since grpclib's client drops unread messages when it gets a GOAWAY."""
        for protocol in list(self.connections):
            if protocol.idle:
                protocol.go_away()

    def close_connections(self) -> None:
        for protocol in list(self.connections):
            if protocol.transport is not None:
                protocol.transport.close()


async def recv_request(stream: Stream[Any, Any]) -> Any:
    """`stream.recv_message()`, a frame that is cut short, compressed or does not parse
    answered INVALID_ARGUMENT (grpclib's own reading answers UNKNOWN or serves what it got)."""
    header = await recv_exactly(stream, 5)
    if not header:
        return None
    compressed, size = struct.unpack(">?I", header)
    if compressed:
        raise GRPCError(Status.INVALID_ARGUMENT, "compressed request messages are not supported")
    body = await recv_exactly(stream, size)  # capped: see LoomHandler
    try:
        return stream._codec.decode(body, stream._recv_type)
    except DecodeError as exc:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"the request message does not parse: {exc}"
        ) from exc


async def recv_exactly(stream: Stream[Any, Any], size: int) -> bytes:
    """`size` bytes of the request, or none at its end."""
    cut_short = GRPCError(Status.INVALID_ARGUMENT, "the request message is cut short")
    try:
        data: bytes = await stream._stream.recv_data(size)
    except AssertionError:  # grpclib's word for a stream that ended mid-frame
        raise cut_short from None
    if data and len(data) != size:
        raise cut_short
    return data
