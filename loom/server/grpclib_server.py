"""grpclib's Server, with what Loom needs of it that grpclib keeps private.

The one place that touches grpclib's internals (`_server`, `_protocol_factory`): the bound port,
closing the listening socket while open connections carry on, and the open connections
themselves, counted (for drain to wait on) and closed at shutdown. grpclib's `close()` cancels
the calls but leaves connection sockets to the garbage collector, which Python 3.11's asyncio
reports as unclosed. Everything here runs in the server's asyncio thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpclib.protocol import H2Protocol
from grpclib.server import Server

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


class GrpclibServer(Server):
    def __init__(self, handlers: Any) -> None:
        super().__init__(handlers)
        self.connections: set[TrackedProtocol] = set()  # the open ones
        self.num_connections = Count()

    def _protocol_factory(self) -> TrackedProtocol:  # type: ignore[override]
        return TrackedProtocol(super()._protocol_factory(), self)

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

    def close_connections(self) -> None:
        for protocol in list(self.connections):
            if protocol.transport is not None:
                protocol.transport.close()
