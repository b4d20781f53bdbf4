"""One HTTP/1.1 connection of the HTTP front, parsed by h11 (as the gRPC side's connections
are by h2), with the network boundary's limits held where its bytes arrive:

- a request's head is at most `max_header_bytes` in all, and comes whole within
  `header_timeout` of its first byte (a new connection's first, of the connection); its lines
  and `Host` are checked before the handler runs (loom/server/openai/head_gate.py); bytes
  that are not HTTP/1.1 are answered 400 (431: a head too large) and the connection closed;
- between requests, a connection is kept `idle_timeout`, and may give its place to a new one;
- one request at a time: a pipelined request waits in h11, the socket unread, until the one
  before is answered; a body is read only as fast as the handler takes it (BODY_CHUNK);
- the write buffers are capped (`write_buffer_bytes`): a `write` waits while they are full.

A lost connection runs its response's `when_lost` callbacks, then cancels its handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
from collections.abc import Callable
from functools import partial
from typing import Any

import h11

from loom.server.boundary.config import BoundaryConfig
from loom.server.openai.errors import HttpError
from loom.server.openai.head_gate import (
    Handler,
    answer,
    head_refusal,
    malformed,
    refusal,
    request_of,
)
from loom.server.openai.message import Body, HttpRequest, Response
from loom.server.openai.origin_policy import OriginPolicy
from loom.server.traffic import Seat

log = logging.getLogger(__name__)
LINGER = 2.0  # seconds a connection answered before its body came reads on (then closes)


class Phase(enum.Enum):
    IDLE = "idle"  # between requests: the next one's first byte is due within idle_timeout
    HEAD = "head"  # a request's head is arriving: due whole within header_timeout
    BUSY = "busy"  # a request is being served
    LINGER = "linger"  # answered before its body came whole: what comes is read and dropped
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
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=config.max_header_bytes)
        self.transport: asyncio.Transport | None = None
        self.phase = Phase.HEAD
        self.timer: asyncio.TimerHandle | None = None
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.held = False  # h11 holds the next request's bytes until this one is done
        self.close_after = False
        self.body: Body | None = None
        self.response: Response | None = None
        self.task: asyncio.Task[None] | None = None

    # asyncio's calls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=self.config.write_buffer_bytes)  # and SO_SNDBUF
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a token goes at once
        self.wait(Phase.HEAD)
        self.on_opened(self)
        self.seat.evict = partial(self.close_for, "made_room")
        self.seat.idle()

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.LINGER:
            return
        if self.phase is Phase.IDLE:
            self.wait(Phase.HEAD)
        self.seat.busy()
        self.h11.receive_data(data)
        self.next_events()

    def eof_received(self) -> bool:
        """The client closed its side: it is gone (HTTP/1.1 clients half-close to leave, not
        to end a request), and so is what it asked for."""
        return False

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.wait(Phase.CLOSED)
        self.can_write.set()
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
                if event is h11.NEED_DATA:
                    break
                if event is h11.PAUSED:
                    self.held = True
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
        request = request_of(event, self.transport, body)
        cors = self.origins.cors(request.headers.get("origin"))
        chunks = event.http_version == b"1.1"
        response = Response(self.send, self.writable, self.abort, cors, body, chunks=chunks)
        self.response = response
        response.close_after = self.close_after
        handler = self.handler
        error = head_refusal(event, request.headers, self.origins.host_allowed)
        if error is not None:
            self.on_refused(error.code or "")
            handler = refusal(error)
        self.wait(Phase.BUSY)
        self.task = asyncio.get_running_loop().create_task(self.run(handler, request, response))

    def malformed(self, exc: h11.RemoteProtocolError) -> None:
        """Bytes that are not HTTP/1.1: answered where no response has begun, then closed."""
        error = malformed(exc, self.config.max_header_bytes)
        self.on_refused(error.code or "")
        if self.response is not None or self.transport is None:
            self.abort()
            return
        with contextlib.suppress(h11.LocalProtocolError):
            self.transport.write(answer(self.h11, error))
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
        done = self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE
        if self.phase is Phase.CLOSED or self.transport is None:
            return
        if self.h11.their_state is h11.SEND_BODY:
            self.linger()
            return
        if self.close_after or not done:
            self.phase = Phase.CLOSED
            self.transport.close()  # once what it has been sent is written
            return
        self.h11.start_next_cycle()
        self.body = self.response = self.task = None
        self.held = False
        if self.h11.trailing_data[0]:
            self.wait(Phase.HEAD)
        else:
            self.wait(Phase.IDLE)
            self.seat.idle()
        self.next_events()

    async def send(self, event: Any) -> None:
        """An h11 event, or bytes h11 has framed the way for (a chunk)."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("the connection is closed")
        self.transport.write(event if isinstance(event, bytes) else self.h11.send(event))
        if not self.can_write.is_set():
            await self.can_write.wait()
            if self.transport.is_closing():
                raise ConnectionError("the connection is closed")

    def linger(self) -> None:
        """Answered before the request came whole (a refusal, a malformed head): close only
        after reading what the client goes on sending, for up to `LINGER` seconds, or until
        it closes. A socket closed with bytes unread is reset, and a reset can destroy the
        answer before the client reads it (as nginx's lingering close and aiohttp's avoid)."""
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
        transport = self.transport
        return transport is not None and not transport.is_closing() and self.can_write.is_set()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # Time and the drain

    def wait(self, phase: Phase) -> None:
        """Enter `phase`, and start its timer (a head's or an idle connection's)."""
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
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(seconds[phase], self.timed_out, phase)

    def timed_out(self, phase: Phase) -> None:
        self.timer = None
        self.close_for("header_timeout" if phase is Phase.HEAD else None)

    def close_for(self, cause: str | None) -> None:
        """Close now (a timer's verdict; or, idle, to make room for a new connection), counted
        as a refusal for `cause`."""
        if cause is not None:
            self.on_refused(cause)
        if self.transport is not None:
            self.transport.close()

    def close_when_idle(self) -> None:
        """Close now if no request is being served; else once its response is sent."""
        self.close_after = True
        if self.response is not None:
            self.response.close_after = True
        if self.phase in (Phase.IDLE, Phase.HEAD) and self.transport is not None:
            self.transport.close()
