"""grpclib's Server, with what Loom needs of it that grpclib keeps private.

The one place that touches grpclib's internals (`Server._server`, `Server._protocol_factory`,
`Handler.accept`, `Connection._connection`, `Stream._stream`): the bound port; closing the
listening socket while open connections carry on; the open connections, counted (drain waits on
them), capped in the streams each may open (HTTP/2 MAX_CONCURRENT_STREAMS), closed with a
GOAWAY when idle at the start of a drain and closed at shutdown (grpclib's `close()` cancels the
calls but leaves the sockets to the garbage collector); a request message refused by its size
before its body is read; and the client's deadline, taken out of grpclib's hands (grpclib answers
a deadline that passes before the handler starts with UNKNOWN, "Internal Server Error"; the
engine enforces deadlines itself, answered DEADLINE_EXCEEDED). Everything here runs in the
server's asyncio thread.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError
from grpclib import GRPCError, Status
from grpclib.metadata import Deadline
from grpclib.protocol import H2Protocol
from grpclib.server import Handler, Server, Stream
from h2.settings import SettingCodes

from loom.server.bridge import Count


class TrackedProtocol(asyncio.Protocol):
    """An H2Protocol that counts itself in its server's open connections while connected."""

    def __init__(self, inner: H2Protocol, server: GrpclibServer) -> None:
        self.inner = inner
        self.server = server
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self.server.num_connections.add(1)
        self.inner.connection_made(transport)
        limit: dict[SettingCodes | int, int] = {
            SettingCodes.MAX_CONCURRENT_STREAMS: self.server.max_streams_per_connection
        }
        self.inner.connection._connection.update_settings(limit)
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

    def go_away(self) -> None:
        """GOAWAY (no new streams here), then close."""
        self.inner.connection._connection.close_connection()
        self.inner.connection.flush()
        if self.transport is not None:
            self.transport.close()


class DeadlineHandler(Handler):
    """grpclib's Handler, keeping each call's deadline (grpc-timeout) for the servicer, away
    from grpclib's own deadline machinery."""

    def accept(self, stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
        stream.loom_deadline = Deadline.from_headers(headers)
        headers = [(name, value) for name, value in headers if name != "grpc-timeout"]
        super().accept(stream, headers, release_stream)


def deadline_of(stream: Stream[Any, Any]) -> Deadline | None:
    """The client's deadline for a call, if it set one."""
    deadline: Deadline | None = getattr(stream._stream, "loom_deadline", None)
    return deadline


class GrpclibServer(Server):
    def __init__(self, handlers: Any, *, max_streams_per_connection: int) -> None:
        super().__init__(handlers)
        self.max_streams_per_connection = max_streams_per_connection
        self.connections: set[TrackedProtocol] = set()  # the open ones
        self.num_connections = Count()

    def _protocol_factory(self) -> TrackedProtocol:  # type: ignore[override]
        """grpclib's, with a DeadlineHandler, in a TrackedProtocol."""
        self.__gc_step__()
        handler = DeadlineHandler(
            self._mapping, self._codec, self._status_details_codec, self.__dispatch__
        )
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
        """Accept no new connections; open ones carry on."""
        if self._server is not None:
            self._server.close()

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


async def recv_bounded(stream: Stream[Any, Any], limit: int) -> Any:
    """`stream.recv_message()`, refusing from its 5-byte header a message over `limit` bytes
    before its body is read (grpclib would read and buffer it whole, up to 4 GiB)."""
    header = await stream._stream.recv_data(5)
    if not header:
        return None
    compressed, size = struct.unpack(">?I", header)
    if compressed:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed request messages are not supported")
    if size > limit:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"the request message has {size} bytes; the limit is max_request_bytes={limit}",
        )
    body = await stream._stream.recv_data(size)
    try:
        return stream._codec.decode(body, stream._recv_type)
    except DecodeError as exc:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"the request message does not parse: {exc}"
        ) from exc
