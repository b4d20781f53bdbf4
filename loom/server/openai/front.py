"""The HTTP front, in the server's asyncio thread beside the gRPC endpoint: its own listener
under the server's connection caps (loom/server/caps.py, shared with the gRPC port), its HTTP/1.1
connections (loom/server/openai/connection.py), and what each drain phase means here.

Over a cap, a connection is answered 503, naming the limit, and closed at the accept. TLS, when
the gRPC port has it, is the same certificate with ALPN http/1.1. Every connection and every
generation request counts in the traffic ledger (loom/server/traffic.py), which the drain
(loom/server/drain.py) waits on.

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
from collections.abc import Awaitable, Callable
from typing import Any

from loom.server.boundary import BoundaryConfig
from loom.server.caps import Seat
from loom.server.listener import Listener
from loom.server.openai.config import HttpConfig
from loom.server.openai.connection import HttpConnection
from loom.server.openai.errors import HttpError
from loom.server.openai.exchange import Exchange, reply_error
from loom.server.openai.message import HttpRequest, Response
from loom.server.openai.origin_policy import OriginPolicy
from loom.server.traffic import DrainPhase, Traffic

log = logging.getLogger(__name__)
Handler = Callable[[HttpRequest, Exchange], Awaitable[None]]


class HttpFront:
    def __init__(
        self,
        handler: Handler,
        config: BoundaryConfig,
        http: HttpConfig,
        traffic: Traffic,
        on_refused: Callable[[str], None],
        tls: ssl.SSLContext | None,
    ) -> None:
        self.config = config
        self.handler = handler
        self.traffic = traffic
        self.caps = traffic.caps
        self.on_refused = on_refused
        self.tls = tls
        self.origins = OriginPolicy(http.http_host, http.allowed_hosts, http.allowed_origins)
        # Over a cap under TLS, a connection is closed unanswered (a plaintext 503 would reach
        # the client as garbage; its handshake has not begun).
        answer = refusal if tls is None else (lambda _cause, _why: b"")
        self.listener = Listener(self.caps, self.accepted, on_refused, answer)
        self.connections: dict[HttpConnection, Seat] = {}  # each one's place under the caps
        traffic.fronts.append(self)

    async def start(self, host: str, port: int) -> int:
        return self.listener.listen(host, port)

    # Connections

    def accepted(self, sock: socket.socket, seat: Seat) -> None:
        """A connection within the caps: its protocol is made on the loop's next turns. Its
        kernel send buffer is capped as its write buffer is (`write_buffer_bytes`): HTTP/1.1
        has no window, and a socket's send buffer, tuned by the kernel, grows to megabytes
        (tcp_wmem), which a reader that stopped would otherwise be sent before its sequence
        ever pauses."""
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.write_buffer_bytes)
        loop = asyncio.get_running_loop()
        connect = loop.connect_accepted_socket(
            lambda: self.connection(seat),
            sock,
            ssl=self.tls,
            ssl_handshake_timeout=self.config.preface_timeout if self.tls else None,
            ssl_shutdown_timeout=self.config.write_timeout if self.tls else None,
        )

        def done(task: asyncio.Task[Any]) -> None:
            if task.cancelled() or task.exception() is not None:
                self.on_refused("tls_handshake" if self.tls else "connection_setup")
                seat.release()
                if task.cancelled():
                    sock.close()

        loop.create_task(connect).add_done_callback(done)

    def connection(self, seat: Seat) -> HttpConnection:
        def opened(connection: HttpConnection) -> None:
            self.connections[connection] = seat
            self.traffic.connections.add(1)
            if self.traffic.phase is not DrainPhase.SERVING:
                connection.close_when_idle()

        return HttpConnection(
            seat,
            self.serve,
            self.config,
            self.origins,
            self.on_refused,
            opened,
            self.closed,
        )

    def closed(self, connection: HttpConnection) -> None:
        seat = self.connections.pop(connection, None)
        if seat is not None:
            seat.release()
            self.traffic.connections.add(-1)

    # Requests

    async def serve(self, request: HttpRequest, response: Response) -> None:
        if self.traffic.refusing:
            self.on_refused("draining")
            response.close_after = True
            await reply_error(response, HttpError(503, "the server is draining", code="draining"))
            return
        if request.method == "OPTIONS" and response.headers:  # a preflight from an allowed origin
            asked = request.headers.get("access-control-request-headers")
            await response.reply(204, headers=self.origins.preflight(asked))
            return
        exchange = Exchange(request, response, self.traffic)
        response.when_lost.append(exchange.lost)
        await self.handler(request, exchange)

    # The drain

    def enter(self, phase: DrainPhase) -> None:
        if phase is DrainPhase.ANNOUNCED:
            self.listener.close()  # the open connections carry on
            for connection in list(self.connections):
                connection.close_when_idle()  # an idle one at once; a busy one after its response

    async def close(self) -> None:
        self.listener.close()
        for connection in list(self.connections):
            connection.abort()
        await asyncio.sleep(0)


def refusal(cause: str, why: str) -> bytes:
    """What a connection over a cap is told, before it has sent anything: a 503 naming why."""
    body = HttpError(503, why, code=cause).encoded()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
