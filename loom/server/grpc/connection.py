"""One client's HTTP/2 connection, on h2's public API: frames in, events dispatched, calls
started and ended, writes under flow control, every limit enforced where the frame arrives.

    data_received ─▶ FrameGate.scan (counts, rates, unfinished frames; the peer's GOAWAY cut
                     out: Loom lets its streams finish, then closes) ─▶ h2.receive_data ─▶ events
        RequestReceived  ─▶ refused at once (draining, over the streams limit, not gRPC),
                            or a Call and its handler task (the endpoint's `Dispatch.admitted`)
        DataReceived / StreamEnded ─▶ the call's request stream
        StreamReset      ─▶ the call ends now (its `when_ended` callbacks: the engine abort)
        WindowUpdated    ─▶ senders waiting for window wake
        PingAckReceived  ─▶ the drain's PING answered: the peer heard
    connection_lost ─▶ every call ends now; nothing more is written

One timer at a time (loom/server/grpc/watchdog.py) says when the connection has waited too
long: for its preface, for the rest of a header block or frame, for its peer to take what it
was sent (`write_timeout`; meanwhile the connection is not read, so a peer that floods PINGs
without reading answers fills only its own socket), or, with no stream open, for a new stream
(`idle_timeout`); with no stream open, its place may go to a new connection (`Seat`). A
connection closes by GOAWAY, then half-closes and reads (discarding) until the peer closes or
`LINGER` passes, so that what it was sent last is not lost to a reset; an abusive one is not
read meanwhile.

Its phase, one at a time: OPEN, then CLOSING (GOAWAY sent, half-closed, lingering: nothing
more is parsed), then LOST (the transport is gone: nothing more is written). While OPEN, it
may be going away at its last stream (`at_last_stream`): the peer sent GOAWAY (then it
closes), or a drain told a proxy to go (then it sends GOAWAY).

Its parts take what they need of it, as callables: the sender a `write`, the streams a `busy`
and a `done`, the watchdog a `due`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
from collections.abc import Callable

import h2.events
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.exceptions import ProtocolError

from loom.server.caps import Seat
from loom.server.grpc.call import Peer
from loom.server.grpc.frames import (
    DRAIN_PING_DATA,
    GATEWAY_SERVICE,
    PROXY_WINDOW,
    drain_ping,
    goaway,
    server_preface,
)
from loom.server.grpc.gate import FrameGate, GateLimits, LimitError
from loom.server.grpc.outbound import Outbound
from loom.server.grpc.streams import Dispatch, Streams
from loom.server.grpc.watchdog import Due, Watchdog, first_due

log = logging.getLogger(__name__)
CONNECTION_WINDOW = 256 << 10  # bytes unread on a connection; its streams keep h2's 64 KiB
LINGER = 2.0  # seconds a closing connection waits for its peer to close


class Phase(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"  # GOAWAY sent, half-closed, lingering: nothing more is parsed
    LOST = "lost"  # the transport is gone: nothing more is written


class Connection(asyncio.Protocol):
    def __init__(
        self,
        dispatch: Dispatch,
        seat: Seat,
        connected: Callable[[], None],
        disconnected: Callable[[], None],
    ) -> None:
        self.dispatch = dispatch
        self.seat = seat  # its place under the connection caps
        self.connected = connected  # the endpoint counts it (once made, even if refused)
        self.disconnected = disconnected
        self.config = config = dispatch.limits
        self.refused = dispatch.refused
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer = Peer()
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        self.gate = FrameGate(GateLimits.of(config), clock=self.loop.time)
        self.out = Outbound(self.h2, self.write, self.closing, self.gate.sent)
        self.streams = Streams(
            dispatch, self.h2, self.gate, self.out, self.peer, self.busy, self.stream_done
        )
        self.made_at = self.loop.time()
        self.idle_since: float | None = self.made_at
        self.phase = Phase.OPEN
        self.why = ""  # why it is closing, once it is
        self.at_last_stream: Callable[[], None] | None = None  # going away: what then
        self.unheard = False  # told to go away by a drain, with its PING not yet answered
        self.watchdog = Watchdog(self.loop, self.due, self.waited_too_long)

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        assert self.transport is not None
        self.peer.address = transport.get_extra_info("peername")
        self.peer.certificate = transport.get_extra_info("peercert")  # with mutual TLS
        tls = transport.get_extra_info("ssl_object")
        if tls is not None and tls.selected_alpn_protocol() != "h2":
            self.connected()  # counted, so that its end gives its place back
            self.refused("tls_alpn")  # gRPC is HTTP/2: a TLS client must agree to h2
            self.transport.abort()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=self.config.write_buffer_bytes)
        self.transport.write(server_preface(self.h2, self.config, CONNECTION_WINDOW))
        self.connected()
        self.watchdog.rearm()

    def data_received(self, data: bytes) -> None:
        if self.phase is not Phase.OPEN:
            return  # lingering: read and dropped
        refusal: LimitError | None = None
        try:
            frames = self.gate.scan(data)
        except LimitError as exc:
            refusal, frames = exc, exc.passed
        try:
            events = self.h2.receive_data(frames)
        except ProtocolError as exc:
            log.debug("HTTP/2 protocol error from %s: %s", self.peer.address, exc)
            self.refused("protocol_error")
            self.close("protocol error", abusive=True)  # h2 has queued its GOAWAY
            return
        try:
            for event in events:
                if isinstance(event, h2.events.PingAckReceived):
                    if event.ping_data == DRAIN_PING_DATA:
                        self.heard()
                else:
                    self.streams.handle(event)
        except LimitError as exc:
            refusal = refusal or exc
        self.out.flush()
        if refusal is not None:
            self.calm_down(refusal)
            return
        if self.gate.goaway_received:  # it opens no more streams: its open ones finish
            self.at_last_stream = self.went_away
            self.stream_done()
        self.watchdog.rearm()

    def pause_writing(self) -> None:
        """The peer is not taking what it is sent: stop reading from it (its PINGs and
        SETTINGS would be answered into memory) and wait."""
        self.out.paused(self.loop.time())
        if self.transport is not None and self.phase is Phase.OPEN:
            self.transport.pause_reading()
        self.watchdog.rearm()

    def resume_writing(self) -> None:
        self.out.resumed()
        if self.transport is not None and self.phase is Phase.OPEN:
            self.transport.resume_reading()
        self.watchdog.rearm()

    def eof_received(self) -> bool | None:
        return None  # the peer is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.why = self.why or "the connection was lost"
        self.phase = Phase.LOST
        self.streams.end_all(self.why)
        self.out.writable.set()  # waiting senders wake and find their call ended
        self.watchdog.stop()
        self.heard()
        self.disconnected()

    # What its parts ask of it

    def write(self, data: bytes) -> None:
        if self.phase is not Phase.LOST and self.transport is not None:
            self.transport.write(data)

    def closing(self) -> str | None:
        """Why it is closing, or lost; None while it is open."""
        return None if self.phase is Phase.OPEN else self.why

    def busy(self) -> None:
        """A stream opened: not idle (nor its place free to give to a new connection)."""
        self.idle_since = None
        self.seat.busy()

    def due(self) -> Due | None:
        if self.phase is not Phase.OPEN:
            return None
        return first_due(
            self.config,
            made_at=self.made_at,
            preface_done=self.gate.preface_done,
            unfinished_since=self.gate.unfinished_since,
            paused_since=self.out.paused_since,
            idle_since=None if self.streams.calls else self.idle_since,
        )

    def stream_done(self) -> None:
        if self.streams.calls or self.phase is not Phase.OPEN:
            return
        if self.at_last_stream is not None:
            self.at_last_stream()
            if self.phase is not Phase.OPEN:
                return
        self.idle_since = self.loop.time()
        self.seat.idle()
        self.watchdog.rearm()

    def went_away(self) -> None:
        self.close("the client went away")

    def waited_too_long(self, cause: str) -> None:
        """The watchdog's verdict (loom/server/grpc/watchdog.py)."""
        if cause == "idle_timeout":
            self.close("idle", error_code=ErrorCodes.NO_ERROR)
            return
        self.refused(cause)
        limit = getattr(self.config, cause)
        why = f"{cause}={limit} s passed"
        self.close(why, error_code=ErrorCodes.NO_ERROR, why=why, abusive=True)

    def calm_down(self, refusal: LimitError) -> None:
        self.refused(refusal.cause)
        log.info("connection from %s: %s", self.peer.address, refusal.message)
        self.close(refusal.cause, error_code=refusal.error_code, why=refusal.message, abusive=True)

    def close(
        self,
        reason: str,
        *,
        error_code: int | None = None,
        why: str = "",
        abusive: bool = False,
    ) -> None:
        """GOAWAY (unless h2 sent one), half-close, and linger for the peer's close; every
        call still open ends now."""
        if self.phase is not Phase.OPEN or self.transport is None:
            return
        self.out.flush()
        if error_code is not None:
            self.out.write_frames(goaway(error_code, self.h2.highest_inbound_stream_id, why))
        self.phase, self.why = Phase.CLOSING, reason
        self.streams.end_all(reason)
        self.out.writable.set()
        if abusive:
            self.transport.pause_reading()
        if self.transport.can_write_eof() and not self.transport.is_closing():
            with contextlib.suppress(OSError):  # the peer may be gone already
                self.transport.write_eof()
        self.watchdog.stop()
        self.loop.call_later(LINGER, self.transport.abort)

    # The drain (loom/server/drain.py)

    def announce_drain(self) -> None:
        """Go away: an idle or a gateway's connection is told now (a PING, then a GOAWAY that
        lets every stream through, in one write), a busy one after its last stream if a proxy."""
        if self.phase is not Phase.OPEN:
            return
        gateway = any(c.path.startswith(GATEWAY_SERVICE) for c in self.streams.calls.values())
        if self.streams.calls and not gateway:
            self.at_last_stream = self.at_last_stream or self.tell_a_proxy
            return
        self.out.write_frames(drain_ping() + goaway(ErrorCodes.NO_ERROR))
        if not self.unheard:
            self.unheard = True
            self.dispatch.traffic.unheard.add(1)

    def tell_a_proxy(self) -> None:
        """The drain's GOAWAY after a busy connection's last stream, if its peer is a proxy
        (a window of 2^30 or more: grpclib's client drops unread messages at a GOAWAY)."""
        self.at_last_stream = None
        if self.h2.remote_settings.initial_window_size >= PROXY_WINDOW:
            self.out.write_frames(goaway(ErrorCodes.NO_ERROR))

    def heard(self) -> None:
        """The drain's PING was answered (every call sent before it has arrived), or the
        connection closed."""
        if self.unheard:
            self.unheard = False
            self.dispatch.traffic.unheard.add(-1)

    def refuse_new_calls(self) -> None:
        """New streams are refused from now on (see `stream_refusal`); an idle connection is
        closed."""
        if not self.streams.calls:
            self.close("draining", error_code=ErrorCodes.NO_ERROR)
