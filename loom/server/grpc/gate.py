"""The frames a peer sends, counted as they arrive and before h2 parses them: where the
connection's limits are enforced (the limits themselves: loom/server/boundary.py).

`FrameGate.scan(data)` reads the byte stream frame by frame (after the 24-byte client
preface), looking at each 9-byte frame header and skipping the payload, so it costs a few
microseconds a frame, and returns the bytes h2 is to parse: every frame but the peer's
GOAWAY, which Loom handles itself (h2, once it has read one, refuses to send anything more,
and the peer's streams in flight could not finish as RFC 9113 §6.8 says they do). A frame
header split between two reads is held back until its last byte arrives. When a frame breaks
a limit, `scan` raises `LimitError`, whose `passed` holds the bytes before that frame. What it
counts:

- the preface: done once the client's magic and the whole of its first SETTINGS frame have
  arrived;
- unfinished work: since when a header block (HEADERS without END_HEADERS, then
  CONTINUATIONs, done when the END_HEADERS frame's payload is whole) or any other frame but
  DATA has been left unfinished, for the connection's header timeout; and a header block's
  size as sent (HPACK-compressed);
- streams that did no work: a stream the peer resets within `PREMATURE` seconds of opening
  it, and a stream the connection refused at once (`did_no_work`). CVE-2023-44487 ("rapid
  reset") opens and resets streams as fast as the wire allows; a peer that has opened
  `min_streams_judged` streams of which more than half did no work is told to calm down
  (Envoy's premature-reset rule);
- control frames (PING, SETTINGS, WINDOW_UPDATE, PRIORITY; DATA that is empty without
  END_STREAM, or padded, or for a stream the server no longer reads; RST_STREAM for a stream
  already closed: each costs the server work or an answer, and carries none for it): each
  costs a token from a bucket of `control_frame_burst`, refilled at
  `control_frames_per_second`, and by `CONTROL_FRAMES_PER_SEND` for each frame of work the
  server sends the peer.

    data:   [preface 24][hdr|SETTINGS][hdr|HEADERS ...][hdr|RST_STREAM][hdr|GOAWAY][hdr|PI
    scan:    magic       preface done  stream 1 opened  stream 1 reset  cut out      held back
                                                        (premature)     (going away)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import attrs
from h2.errors import ErrorCodes

from loom.server.boundary import BoundaryConfig

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_SIZE = 9
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x6, 0x7, 0x8, 0x9
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
CONTROL_FRAMES = frozenset({PING, SETTINGS, WINDOW_UPDATE, PRIORITY})
PREMATURE = 1.0  # seconds: a stream reset younger than this did no work (Envoy's default)
CONTROL_FRAMES_PER_SEND = 10  # control frames each frame the server sends pays for (Envoy)


class LimitError(Exception):
    """A limit the peer broke: the connection ends with a GOAWAY of `error_code`, its debug
    data `message`; `cause` is the metrics label (the limit's name)."""

    def __init__(self, cause: str, message: str, error_code: ErrorCodes) -> None:
        super().__init__(message)
        self.cause = cause
        self.message = message
        self.error_code = error_code
        self.passed = b""  # from `scan`: the bytes before the breaking frame


@attrs.frozen(kw_only=True)
class GateLimits:
    max_header_bytes: int
    min_streams_judged: int
    control_frame_burst: int
    control_frames_per_second: float

    @classmethod
    def of(cls, config: BoundaryConfig) -> GateLimits:
        return cls(
            max_header_bytes=config.max_header_bytes,
            min_streams_judged=config.reset_streams_judged,
            control_frame_burst=config.control_frame_burst,
            control_frames_per_second=config.control_frames_per_second,
        )


@attrs.define
class Frame:
    """The frame being read: its header's fields."""

    kind: int
    flags: int
    stream_id: int
    length: int
    started: float
    passed: bool  # h2 parses it (a GOAWAY is cut out)


class FrameGate:
    def __init__(self, limits: GateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.preface_left = len(PREFACE)
        self.preface_done = False  # the magic and the first SETTINGS frame have arrived
        self.goaway_received = False  # the peer sent GOAWAY: it opens no more streams
        self.header = bytearray()  # a frame header still arriving
        self.frame: Frame | None = None  # the frame whose payload is arriving
        self.payload_left = 0
        self.header_block_since: float | None = None  # a header block is open since then
        self.header_block_bytes = 0
        self.opened: OrderedDict[int, float] = OrderedDict()  # young streams: when opened
        self.reading: set[int] = set()  # streams the server still reads
        self.num_streams = 0
        self.num_idle_streams = 0  # reset while young, or refused at once
        self.tokens = float(limits.control_frame_burst)
        self.refilled = clock()

    @property
    def unfinished_since(self) -> float | None:
        """Since when a header block, or a frame other than DATA, has been left unfinished."""
        frame = self.frame
        partial = frame.started if frame is not None and frame.kind != DATA else None
        times = [t for t in (self.header_block_since, partial) if t is not None]
        return min(times, default=None)

    def scan(self, data: bytes) -> bytes:
        """The bytes of `data` (and of reads before it) h2 is to parse; raises `LimitError`
        when a frame breaks a limit."""
        view, offset, out = memoryview(data), 0, bytearray()
        if self.preface_left:
            offset = min(self.preface_left, len(data))
            self.preface_left -= offset
            out += view[:offset]
        while offset < len(data):
            if self.frame is not None:
                step = min(self.payload_left, len(data) - offset)
                if self.frame.passed:
                    out += view[offset : offset + step]
                self.payload_left -= step
                offset += step
                if not self.payload_left:
                    self.frame_done(self.frame)
                continue
            step = min(FRAME_HEADER_SIZE - len(self.header), len(data) - offset)
            self.header += view[offset : offset + step]
            offset += step
            if len(self.header) < FRAME_HEADER_SIZE:
                break
            header, self.header = bytes(self.header), bytearray()
            try:
                frame = self.frame_begins(header)
            except LimitError as refusal:
                refusal.passed = bytes(out)
                raise
            if frame.passed:
                out += header
            if frame.length:
                self.frame, self.payload_left = frame, frame.length
            else:
                self.frame_done(frame)
        return bytes(out)

    def frame_begins(self, header: bytes) -> Frame:
        length = int.from_bytes(header[:3], "big")
        kind, flags = header[3], header[4]
        stream_id = int.from_bytes(header[5:9], "big") & 0x7FFF_FFFF
        frame = Frame(kind, flags, stream_id, length, self.clock(), passed=kind != GOAWAY)
        if kind == HEADERS:
            self.headers(stream_id, length)
        elif kind == CONTINUATION:
            self.grow_header_block(length)
        elif kind == RST_STREAM:
            self.reset(stream_id)
        elif kind == DATA:
            self.data(frame)
        if kind in CONTROL_FRAMES:
            self.control_frame()
        return frame

    def frame_done(self, frame: Frame) -> None:
        """The frame's last byte has arrived."""
        self.frame = None
        if frame.kind == SETTINGS and not frame.flags & ACK:
            self.preface_done = True
        elif frame.kind in (HEADERS, CONTINUATION) and frame.flags & END_HEADERS:
            self.header_block_since = None
        elif frame.kind == GOAWAY:
            self.goaway_received = True
        if frame.kind in (HEADERS, DATA) and frame.flags & END_STREAM:
            self.reading.discard(frame.stream_id)

    def headers(self, stream_id: int, length: int) -> None:
        if stream_id not in self.opened and stream_id not in self.reading:
            self.forget_old_streams()
            self.num_streams += 1
            self.opened[stream_id] = self.clock()
            self.reading.add(stream_id)
        self.header_block_since, self.header_block_bytes = self.clock(), 0
        self.grow_header_block(length)

    def grow_header_block(self, length: int) -> None:
        self.header_block_bytes += length
        limit = self.limits.max_header_bytes
        if self.header_block_bytes > limit:
            raise LimitError(
                "max_header_bytes",
                f"a header block of over {limit} bytes; the limit is max_header_bytes={limit}",
                ErrorCodes.ENHANCE_YOUR_CALM,
            )

    def data(self, frame: Frame) -> None:
        empty = not frame.length and not frame.flags & END_STREAM
        if empty or frame.flags & PADDED or frame.stream_id not in self.reading:
            self.control_frame()

    def reset(self, stream_id: int) -> None:
        if stream_id not in self.reading:
            self.control_frame()  # nothing to reset: answered, ended, or never opened
        self.reading.discard(stream_id)
        opened = self.opened.pop(stream_id, None)
        if opened is not None and self.clock() - opened < PREMATURE:
            self.did_no_work()

    def closed(self, stream_id: int) -> None:
        """The server no longer reads the stream (answered, or its call ended)."""
        self.reading.discard(stream_id)

    def did_no_work(self, stream_id: int | None = None) -> None:
        """A stream reset young, or refused at once; past the rule, calm down."""
        if stream_id is not None:
            self.opened.pop(stream_id, None)
            self.reading.discard(stream_id)
        self.num_idle_streams += 1
        judged = self.limits.min_streams_judged
        if self.num_streams >= judged and 2 * self.num_idle_streams > self.num_streams:
            raise LimitError(
                "reset_streams_judged",
                f"{self.num_idle_streams} of {self.num_streams} streams reset or refused "
                f"before doing any work (judged from reset_streams_judged={judged})",
                ErrorCodes.ENHANCE_YOUR_CALM,
            )

    def forget_old_streams(self) -> None:
        horizon = self.clock() - PREMATURE
        while self.opened and next(iter(self.opened.values())) < horizon:
            self.opened.popitem(last=False)

    def control_frame(self) -> None:
        now = self.clock()
        burst, rate = self.limits.control_frame_burst, self.limits.control_frames_per_second
        self.tokens = min(burst, self.tokens + (now - self.refilled) * rate)
        self.refilled = now
        self.tokens -= 1
        if self.tokens < 0:
            raise LimitError(
                "control_frame_burst",
                f"over control_frame_burst={burst} control frames (PING, SETTINGS, "
                f"WINDOW_UPDATE, PRIORITY, RST_STREAM or DATA doing no work) beyond "
                f"control_frames_per_second={rate}",
                ErrorCodes.ENHANCE_YOUR_CALM,
            )

    def sent(self, num_frames: int) -> None:
        """The server sent the peer `num_frames` frames of work (HEADERS, DATA)."""
        burst = self.limits.control_frame_burst
        self.tokens = min(burst, self.tokens + num_frames * CONTROL_FRAMES_PER_SEND)
