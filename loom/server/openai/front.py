"""The HTTP front, in the server's asyncio thread beside the gRPC endpoint: aiohttp's low-level
server with Loom's connection caps, counts and drain.

Connections: over `max_connections` HTTP connections in all, or `max_connections_per_peer` from
one address, a connection is answered 503 and closed at once (counted as a refusal); each
connection's write buffers (its own and the kernel's) are capped at `write_buffer_bytes`; a
new connection whose first request's head has not come whole within `header_timeout` is
closed (slowloris; counted), an idle keep-alive connection after `idle_timeout`. TLS, when the
gRPC port has it, is the same certificate with ALPN http/1.1. Every connection counts in the
endpoint's `num_connections`, every generation request in its `arriving` and `num_in_flight`:
the drain (loom/server/drain.py) waits on both fronts.

A drain, here: ANNOUNCED stops listening, and every response from then on says
`Connection: close` (idle keep-alive connections are closed; a request already sent is still
served); REFUSING answers new requests 503; requests in flight run to their end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from loom.server.boundary.config import BoundaryConfig
from loom.server.boundary.listener import peer_host
from loom.server.bridge import Count
from loom.server.drain import DrainPhase
from loom.server.openai.errors import HttpError
from loom.server.openai.exchange import Exchange

log = logging.getLogger(__name__)
Handler = Callable[[web.BaseRequest, Exchange], Awaitable[web.StreamResponse]]


class Connections(web.Server):
    """aiohttp's server, told of each connection made and lost."""

    def __init__(
        self,
        front: HttpFront,
        serve: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        **kwargs: Any,
    ) -> None:
        super().__init__(serve, handler_cancellation=True, **kwargs)
        self.front = front

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.front.connected(handler, transport)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.front.disconnected(handler)


class HttpFront:
    def __init__(
        self,
        handler: Handler,
        config: BoundaryConfig,
        counts: Any,  # the endpoint's: num_connections, arriving, num_in_flight (Counts)
        on_refused: Callable[[str], None],
        tls: ssl.SSLContext | None,
    ) -> None:
        self.config = config
        self.handler = handler
        self.num_connections: Count = counts.num_connections
        self.arriving: Count = counts.arriving
        self.num_in_flight: Count = counts.num_in_flight
        self.on_refused = on_refused
        self.tls = tls
        self.hosts: dict[RequestHandler, str] = {}
        self.per_peer: Counter[str] = Counter()
        self.exchanges: dict[RequestHandler, Exchange] = {}  # the request each is serving
        self.heads_due: dict[RequestHandler, asyncio.TimerHandle] = {}  # no request yet
        self.phase = DrainPhase.SERVING
        self.server: asyncio.Server | None = None
        self.connections = Connections(
            self,
            self.serve,
            keepalive_timeout=config.idle_timeout,
            max_line_size=config.max_header_bytes,
            max_field_size=config.max_header_bytes,
            access_log=None,
        )

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            self.connections,
            host,
            port,
            ssl=self.tls,
            ssl_handshake_timeout=self.config.preface_timeout if self.tls else None,
            backlog=1024,
        )
        return int(self.server.sockets[0].getsockname()[1])

    # Connections

    def connected(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        host = peer_host(transport.get_extra_info("peername"))
        limit_buffers(transport, self.config.write_buffer_bytes)
        over = self.over_cap(host)
        self.hosts[handler] = host
        self.per_peer[host] += 1
        self.num_connections.add(1)
        if over is not None:
            self.on_refused(over[0])
            error = HttpError(503, over[1], code=over[0])
            body = error.encoded()
            transport.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            handler.close()
            transport.close()
        elif self.phase is not DrainPhase.SERVING:
            handler.close()
        else:
            loop = asyncio.get_running_loop()
            due = loop.call_later(self.config.header_timeout, self.head_late, handler)
            self.heads_due[handler] = due

    def head_late(self, handler: RequestHandler) -> None:
        """No request head came whole in time: the connection is closed."""
        if self.heads_due.pop(handler, None) is not None:
            self.on_refused("header_timeout")
            handler.force_close()

    def over_cap(self, host: str) -> tuple[str, str] | None:
        if len(self.hosts) >= self.config.max_connections:
            return "max_connections", (
                f"{len(self.hosts)} HTTP connections are open; the limit is "
                f"max_connections={self.config.max_connections}"
            )
        if self.per_peer[host] >= self.config.max_connections_per_peer:
            return "max_connections_per_peer", (
                f"{self.per_peer[host]} HTTP connections are open from your address; the "
                f"limit is max_connections_per_peer={self.config.max_connections_per_peer}"
            )
        return None

    def disconnected(self, handler: RequestHandler) -> None:
        if (due := self.heads_due.pop(handler, None)) is not None:
            due.cancel()
        exchange = self.exchanges.pop(handler, None)
        if exchange is not None:
            exchange.lost()  # before aiohttp cancels the handler: the engine request ends now
        host = self.hosts.pop(handler, None)
        if host is not None:
            self.per_peer[host] -= 1
            if not self.per_peer[host]:
                del self.per_peer[host]
            self.num_connections.add(-1)

    # Requests

    async def serve(self, request: web.BaseRequest) -> web.StreamResponse:
        protocol: Any = request.protocol
        if (due := self.heads_due.pop(protocol, None)) is not None:
            due.cancel()
        if self.phase in (DrainPhase.REFUSING, DrainPhase.CLOSED):
            self.on_refused("draining")
            response = error_response(HttpError(503, "the server is draining", code="draining"))
            response.force_close()
            return response
        exchange = Exchange(request, self.arriving, self.num_in_flight)
        self.exchanges[protocol] = exchange
        exchange.close_after = self.phase is not DrainPhase.SERVING
        try:
            return await self.handler(request, exchange)
        finally:
            if self.exchanges.get(protocol) is exchange:
                del self.exchanges[protocol]

    # The drain

    def enter(self, phase: DrainPhase) -> None:
        self.phase = phase
        if phase is DrainPhase.ANNOUNCED:
            if self.server is not None:
                self.server.close()  # the open connections carry on
            for exchange in self.exchanges.values():
                exchange.close_after = True
            for handler in self.connections.connections:
                handler.close()  # an idle one at once; a busy one after its response

    async def close(self) -> None:
        self.phase = DrainPhase.CLOSED
        if self.server is not None:
            self.server.close()
        for handler in self.connections.connections:
            handler.force_close()
        await asyncio.sleep(0)


def limit_buffers(transport: asyncio.Transport, size: int) -> None:
    """At most `size` bytes wait in the connection's write buffer before a send waits, and
    about as many in the kernel's: HTTP/1.1 has no window, and a socket's send buffer,
    tuned by the kernel, grows to megabytes (tcp_wmem), which a reader that stopped would
    otherwise be sent before its sequence ever pauses."""
    transport.set_write_buffer_limits(high=size)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)


def error_response(error: HttpError, headers: dict[str, str] | None = None) -> web.Response:
    response = web.Response(
        status=error.status,
        body=error.encoded(),
        content_type="application/json",
        headers={**(headers or {}), **error.headers()},
    )
    if error.status in (408, 413):  # a body left unread: the connection cannot carry on
        response.force_close()
    return response
