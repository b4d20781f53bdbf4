"""One HTTP/1.1 connection of the HTTP front, parsed by h11 (as the gRPC side's connections
are by h2), with the network boundary's limits held where its bytes arrive:

- a request's head is at most `max_header_bytes` in all, and comes whole within
  `header_timeout` of its first byte (a new connection's first, of the connection); its lines,
  framing and `Host` are checked before the handler runs (loom/server/openai/head_gate.py);
  bytes that are not HTTP/1.1 are answered 400 (431: a head too large), then closed;
- between requests, a connection is kept `idle_timeout`, and may give its place to a new one;
- one request at a time: a pipelined request waits in h11, the socket unread, until the one
  before is answered; a body is read only as fast as the handler takes it (BODY_CHUNK); what
  comes after a request that said it was the last is dropped;
- writes wait while the client reads slowly; one taking nothing for `write_timeout` is cut off.

A lost connection runs its response's `when_lost` callbacks, then cancels its handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import h11

from loom.server.boundary import BoundaryConfig
from loom.server.caps import Seat
from loom.server.openai import head_gate
from loom.server.openai.errors import HttpError
from loom.server.openai.head_gate import Handler
from loom.server.openai.message import Body, HttpRequest, Response
from loom.server.openai.origin_policy import OriginPolicy
from loom.server.openai.outbound import Outbound

log = logging.getLogger(__name__)
LINGER = 2.0  # seconds a connection answered before its request came whole reads on, then closes
FINISHED = (h11.MUST_CLOSE, h11.CLOSED)  # the client said its request was its last


class Phase(enum.Enum):
    IDLE = "idle"  # between requests: the next one's first byte is due within idle_timeout
    HEAD = "head"  # a request's head is arriving: due whole within header_timeout
    BUSY = "busy"  # a request is being served
    LINGER = "linger"  # answered before its request came whole: what comes is read and dropped
    CLOSED = "closed"


class HttpConnection(asyncio.Protocol):
    def __init__(
        self,
        seat: Seat,
        handler: Handler,
        config: BoundaryConfig,
        origins: OriginPolicy,
        on_refused: Callable[[str], None],
        on_opened: Callable[[HttpConnection], None],
        on_closed: Callable[[HttpConnection], None],
    ) -> None:
        self.seat = seat  # its place under the connection caps: idle, it may be evicted
        self.handler = handler
        self.config = config
        self.origins = origins  # the Hosts it answers to, the origins that get CORS headers
        self.on_refused = on_refused
        self.on_opened = on_opened  # made (after its TLS handshake)
        self.on_closed = on_closed
        self.h11 = parser(config)
        self.transport: asyncio.Transport | None = None
        self.out: Outbound | None = None
        self.phase = Phase.HEAD
        self.timer: asyncio.TimerHandle | None = None
        self.held = False  # h11 holds the next request's bytes until this one is done
        self.close_after = False
        self.body: Body | None = None
        self.response: Response | None = None
        self.task: asyncio.Task[None] | None = None

    # asyncio's calls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.out = Outbound(transport, self.config, partial(self.on_refused, "write_timeout"))
        self.wait(Phase.HEAD)
        self.on_opened(self)
        self.seat.evict = partial(self.close_for, "made_room")
        self.seat.idle()

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.LINGER or self.h11.their_state in FINISHED:
            return
        if self.phase is Phase.IDLE:
            data = data.lstrip(b"\r\n")  # blank lines before a request pass (RFC 9112 2.2)
            if not data:
                return
            self.wait(Phase.HEAD)
        self.seat.busy()
        self.h11.receive_data(data)
        self.next_events()

    def eof_received(self) -> bool:
        return False  # the client is gone (HTTP/1.1 clients half-close to leave), its request too

    def pause_writing(self) -> None:
        if self.out is not None:
            self.out.paused()

    def resume_writing(self) -> None:
        if self.out is not None:
            self.out.resumed()

    def connection_lost(self, exc: Exception | None) -> None:
        self.wait(Phase.CLOSED)
        if self.out is not None:
            self.out.lost()
        if self.body is not None:
            self.body.lose()
        if self.response is not None:
            self.response.lose()  # before the handler is cancelled: its request ends now
        if self.task is not None:
            self.task.cancel()
        self.on_closed(self)

    # Reading

    def next_events(self) -> None:
        try:
            while self.phase is not Phase.CLOSED:
                event = self.h11.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    self.held = event is h11.PAUSED
                    break
                if isinstance(event, h11.ConnectionClosed):
                    break
                if isinstance(event, h11.Request):
                    self.head(event)
                elif isinstance(event, h11.Data) and self.body is not None:
                    self.body.feed(event.data)
                elif isinstance(event, h11.EndOfMessage) and self.body is not None:
                    self.body.end()
        except h11.RemoteProtocolError as exc:
            self.malformed(exc)
        self.steer_reading()

    def steer_reading(self) -> None:
        """Read the socket unless a pipelined request or a body's unread bytes wait."""
        if self.transport is None or self.phase is Phase.CLOSED:
            return
        full = self.body is not None and self.body.full
        if self.held or full:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def head(self, event: h11.Request) -> None:
        assert self.transport is not None
        self.body = body = Body(self.steer_reading, self.send_continue)
        request = head_gate.request_of(event, self.transport, body)
        cors = self.origins.cors(request.headers.get("origin"))
        framing = "head" if request.method == "HEAD" else "chunks" * (event.http_version == b"1.1")
        response = Response(self.send, self.writable, self.abort, cors, body, framing)
        self.response = response
        response.close_after = self.close_after
        handler = self.handler
        error = head_gate.head_refusal(event, request.headers, self.origins.host_allowed)
        if error is not None:
            self.on_refused(error.code or "")
            handler = head_gate.refusal(error)
        self.wait(Phase.BUSY)
        self.task = asyncio.get_running_loop().create_task(self.run(handler, request, response))

    def malformed(self, exc: h11.RemoteProtocolError) -> None:
        """Bytes that are not HTTP/1.1: answered unless a response has begun, then closed."""
        error = head_gate.malformed(exc, self.config.max_header_bytes)
        self.on_refused(error.code or "")
        if self.response is not None and self.response.started:
            self.abort()
            return
        if self.response is not None and self.task is not None:
            self.response.lose()
            self.task.cancel()
        if self.transport is not None:
            with contextlib.suppress(h11.LocalProtocolError):
                self.transport.write(head_gate.answer(self.h11, error))
            self.linger()

    # Serving

    async def run(self, handler: Handler, request: HttpRequest, response: Response) -> None:
        try:
            await handler(request, response)
            if not response.started:
                await response.reply(500, HttpError(500, "no response", code="internal").encoded())
            elif not response.ended:
                await response.end()
        except (ConnectionError, asyncio.CancelledError):
            return  # the connection is gone
        except Exception:
            log.exception("the HTTP handler failed")
            self.abort()
            return
        self.next_request()

    def next_request(self) -> None:
        """The response is whole: the connection waits for the next request, or closes."""
        if self.phase is Phase.CLOSED or self.out is None:
            return
        if self.h11.their_state is h11.SEND_BODY:
            self.linger()
        elif self.close_after or self.h11.their_state is not h11.DONE:
            self.phase = Phase.CLOSED
            self.out.close(self.config.write_timeout)  # once what it was sent is written
        else:
            # A fresh parser for the next request (h11 keeps nothing across requests but the
            # bytes after the last), without blank lines before it, which h11 would refuse.
            after = self.h11.trailing_data[0].lstrip(b"\r\n")
            self.h11 = parser(self.config)
            self.body = self.response = self.task = None
            self.held = False
            if after:
                self.h11.receive_data(after)  # (b"" would say the client closed)
                self.wait(Phase.HEAD)
            else:
                self.wait(Phase.IDLE)
                self.seat.idle()
            self.next_events()

    async def send(self, event: Any) -> None:
        if self.out is None:
            raise ConnectionError("the connection is not made")
        await self.out.send(event if isinstance(event, bytes) else self.h11.send(event))

    def linger(self) -> None:
        """Answered before the request came whole: drop what comes for LINGER s, then close
        (closed with bytes unread, a socket is reset, which can destroy the answer: nginx's
        lingering close)."""
        assert self.transport is not None
        self.wait(Phase.LINGER)
        self.body = None
        self.held = False
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.steer_reading()

    def send_continue(self) -> None:
        if self.h11.they_are_waiting_for_100_continue and self.transport is not None:
            self.transport.write(
                self.h11.send(h11.InformationalResponse(status_code=100, headers=[]))
            )

    def writable(self) -> bool:
        return self.out is not None and self.out.writable()

    def abort(self) -> None:
        if self.out is not None:
            self.out.abort()

    # Time and the drain

    def wait(self, phase: Phase) -> None:
        """Enter `phase`, and start its timer (a head's, an idle connection's, a linger's)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.phase = phase
        seconds = {
            Phase.HEAD: self.config.header_timeout,
            Phase.IDLE: self.config.idle_timeout,
            Phase.LINGER: LINGER,
        }
        if phase in seconds:
            cause = "header_timeout" if phase is Phase.HEAD else None
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(seconds[phase], self.close_for, cause)

    def close_for(self, cause: str | None) -> None:
        """Close now (a timer's verdict, or room made), counted for `cause`; LINGER to flush."""
        if cause is not None:
            self.on_refused(cause)
        if self.out is not None:
            self.out.close(LINGER)

    def close_when_idle(self) -> None:
        """Close now if no request is being served; else once its response is sent."""
        self.close_after = True
        if self.response is not None:
            self.response.close_after = True
        if self.phase in (Phase.IDLE, Phase.HEAD):
            self.close_for(None)


def parser(config: BoundaryConfig) -> h11.Connection:
    """h11's server side for one request (and what follows it), its head's bytes bounded."""
    return h11.Connection(h11.SERVER, max_incomplete_event_size=config.max_header_bytes)
