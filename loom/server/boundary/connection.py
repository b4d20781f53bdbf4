"""One client's HTTP/2 connection, on h2's public API: frames in, events dispatched, calls
started and ended, writes under flow control, every limit enforced where the frame arrives.

    data_received ─▶ FrameGate.scan (counts, rates, unfinished frames; the peer's GOAWAY cut
                     out: Loom lets its streams finish, then closes) ─▶ h2.receive_data ─▶ events
        RequestReceived  ─▶ refused at once (draining, over the streams limit, not gRPC),
                            or a Call and its handler task (Endpoint.serve)
        DataReceived / StreamEnded ─▶ the call's request stream
        StreamReset      ─▶ the call ends now (its `when_ended` callbacks: the engine abort)
        WindowUpdated    ─▶ senders waiting for window wake
        PingAckReceived  ─▶ the drain's PING answered: the peer heard
    connection_lost ─▶ every call ends now; nothing more is written

One timer at a time (loom/server/boundary/watchdog.py) says when the connection has waited too
long: for its preface, for the rest of a header block or frame, for its peer to take what it
was sent (`write_timeout`; meanwhile the connection is not read, so a peer that floods PINGs
without reading answers fills only its own socket), or, with no stream open, for a new stream
(`idle_timeout`); with no stream open, its place may go to a new connection (`Seat`). A
connection closes by GOAWAY, then half-closes and reads (discarding) until the peer closes or
`LINGER` passes, so that what it was sent last is not lost to a reset; an abusive one is not
read meanwhile.

What grpclib's own server does differently, and why Loom does not use it: a stream reset
before its handler task starts is never released (rapid reset keeps ~9 KB a stream for the
connection's life, and every later SETTINGS or WINDOW_UPDATE walks the dead streams); it
answers PINGs and SETTINGS into an unbounded buffer for a peer that does not read; it has no
preface, header, body or idle timeouts and no connection limits; and on a lost connection it
ends a handler only by cancelling its task, which a swallowed cancellation defeats (Python
3.11's asyncio.wait_for swallowed one, and the request ran on, writing into a dead socket).
Here the connection owns each stream's end, and a call's end runs what must not outlive it
(the engine abort) itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING, Any

import h2.events
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes, Settings

from loom.server.boundary.frames import (
    ALL_STREAMS,
    DRAIN_PING_DATA,
    PROXY_WINDOW,
    advertised,
    drain_ping,
    goaway,
)
from loom.server.boundary.gate import FrameGate, GateLimits, LimitError
from loom.server.boundary.outbound import Outbound
from loom.server.boundary.streams import Streams
from loom.server.boundary.watchdog import Watchdog
from loom.server.caps import Seat

if TYPE_CHECKING:
    from loom.server.boundary.endpoint import Endpoint

log = logging.getLogger(__name__)
CONNECTION_WINDOW = 256 << 10  # bytes unread on a connection; its streams keep h2's 64 KiB
LINGER = 2.0  # seconds a closing connection waits for its peer to close


class Connection(asyncio.Protocol):
    def __init__(self, endpoint: Endpoint, seat: Seat) -> None:
        self.endpoint = endpoint
        self.seat = seat  # its place under the connection caps
        self.host = seat.host  # the peer's address, as the listener counts it
        self.config = endpoint.config
        self.budget = endpoint.budget
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer_address: Any = None
        self.peer_cert: dict[str, Any] | None = None
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        self.gate = FrameGate(
            GateLimits(
                max_header_bytes=self.config.max_header_bytes,
                min_streams_judged=self.config.reset_streams_judged,
                control_frame_burst=self.config.control_frame_burst,
                control_frames_per_second=self.config.control_frames_per_second,
            ),
            clock=self.loop.time,
        )
        self.out = Outbound(self)
        self.streams = Streams(self)
        self.made_at = self.loop.time()
        self.idle_since: float | None = self.made_at
        self.closing: str | None = None  # why it is closing: nothing more is parsed
        self.lost = False
        self.watchdog = Watchdog(self)
        self.unheard = False  # told to go away, with a PING not yet answered
        self.goaway_after_last_stream = False  # in a drain, for a proxy
        self.peer_going_away = False  # the peer sent GOAWAY

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        assert self.transport is not None
        self.peer_address = transport.get_extra_info("peername")
        self.peer_cert = transport.get_extra_info("peercert")  # with mutual TLS
        tls = transport.get_extra_info("ssl_object")
        if tls is not None and tls.selected_alpn_protocol() != "h2":
            self.endpoint.connected(self)  # counted, so that its end gives its place back
            self.endpoint.refused("tls_alpn")  # gRPC is HTTP/2: a TLS client must agree to h2
            self.transport.abort()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=self.config.write_buffer_bytes)
        self.h2.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: ALL_STREAMS,
                SettingCodes.MAX_HEADER_LIST_SIZE: self.config.max_header_bytes,
            },
        )
        # The decoded size is hpack's to enforce, and the settings above are current at once
        # (no ACK will apply them): so its decoder is told too.
        self.h2.decoder.max_header_list_size = self.config.max_header_bytes
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        preface = self.h2.data_to_send()
        self.transport.write(advertised(preface, self.config.max_streams_per_connection))
        self.endpoint.connected(self)
        self.watchdog.rearm()

    def data_received(self, data: bytes) -> None:
        if self.closing is not None:
            return  # lingering: read and dropped
        refusal: LimitError | None = None
        try:
            frames = self.gate.scan(data)
        except LimitError as exc:
            refusal, frames = exc, exc.passed
        try:
            events = self.h2.receive_data(frames)
        except ProtocolError as exc:
            log.debug("HTTP/2 protocol error from %s: %s", self.peer_address, exc)
            self.endpoint.refused("protocol_error")
            self.close("protocol error", abusive=True)  # h2 has queued its GOAWAY
            return
        try:
            for event in events:
                self.handle(event)
        except LimitError as exc:
            refusal = refusal or exc
        self.out.flush()
        if refusal is not None:
            self.calm_down(refusal)
            return
        if self.gate.goaway_received and not self.peer_going_away:
            self.peer_going_away = True  # it opens no more streams; its open ones finish
            self.stream_done()
        self.watchdog.rearm()

    def pause_writing(self) -> None:
        """The peer is not taking what it is sent: stop reading from it (its PINGs and
        SETTINGS would be answered into memory) and wait."""
        self.out.writable.clear()
        self.out.paused_since = self.loop.time()
        if self.transport is not None and self.closing is None:
            self.transport.pause_reading()
        self.watchdog.rearm()

    def resume_writing(self) -> None:
        self.out.writable.set()
        self.out.paused_since = None
        if self.transport is not None and self.closing is None and not self.lost:
            self.transport.resume_reading()
        self.watchdog.rearm()

    def eof_received(self) -> bool | None:
        return None  # the peer is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.closing = self.closing or "the connection was lost"
        self.streams.end_all(self.closing)
        self.out.writable.set()  # waiting senders wake and find their call ended
        self.watchdog.stop()
        self.heard()
        self.endpoint.disconnected(self)

    # Events

    def handle(self, event: Any) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self.streams.open(event)
        elif isinstance(event, h2.events.DataReceived):
            self.streams.data(event)
        elif isinstance(event, h2.events.StreamEnded):
            self.streams.ended(event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            self.streams.reset(event)
        elif isinstance(event, h2.events.WindowUpdated):
            self.streams.window_updated(event.stream_id)
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            if SettingCodes.INITIAL_WINDOW_SIZE in event.changed_settings:
                self.streams.window_updated(0)
        elif isinstance(event, h2.events.PingAckReceived) and event.ping_data == DRAIN_PING_DATA:
            self.heard()

    def refused(self, cause: str) -> None:
        self.endpoint.refused(cause)

    def stream_done(self) -> None:
        if self.streams.calls or self.closing is not None:
            return
        if self.peer_going_away:
            self.close("the client went away")
            return
        self.idle_since = self.loop.time()
        self.seat.idle()
        if self.goaway_after_last_stream:
            self.goaway_after_last_stream = False
            if self.h2.remote_settings.initial_window_size >= PROXY_WINDOW:
                self.out.write_frames(goaway(ErrorCodes.NO_ERROR))
        self.watchdog.rearm()

    def waited_too_long(self, cause: str) -> None:
        """The watchdog's verdict (loom/server/boundary/watchdog.py)."""
        if cause == "idle_timeout":
            self.close("idle", error_code=ErrorCodes.NO_ERROR)
            return
        self.endpoint.refused(cause)
        limit = getattr(self.config, cause)
        why = f"{cause}={limit} s passed"
        self.close(why, error_code=ErrorCodes.NO_ERROR, why=why, abusive=True)

    def calm_down(self, refusal: LimitError) -> None:
        self.endpoint.refused(refusal.cause)
        log.info("connection from %s: %s", self.peer_address, refusal.message)
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
        if self.closing is not None or self.transport is None:
            return
        self.out.flush()
        if error_code is not None:
            self.out.write_frames(goaway(error_code, self.h2.highest_inbound_stream_id, why))
        self.closing = reason
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
        """Go away: an idle connection is told now (a PING, then a GOAWAY that lets every
        stream through, in one write), a busy one after its last stream if it is a proxy."""
        if self.closing is not None:
            return
        if self.streams.calls:
            self.goaway_after_last_stream = True
            return
        self.out.write_frames(drain_ping() + goaway(ErrorCodes.NO_ERROR))
        if not self.unheard:
            self.unheard = True
            self.endpoint.traffic.unheard.add(1)

    def heard(self) -> None:
        """The drain's PING was answered (every call sent before it has arrived), or the
        connection closed."""
        if self.unheard:
            self.unheard = False
            self.endpoint.traffic.unheard.add(-1)

    def refuse_new_calls(self) -> None:
        """New streams are refused from now on (see `stream_refusal`); an idle connection is
        closed."""
        if not self.streams.calls:
            self.close("draining", error_code=ErrorCodes.NO_ERROR)
