"""The frames a peer sends, counted as they arrive and before h2 parses them: where the
connection's limits are enforced (the limits themselves: loom/server/boundary/config.py).

`FrameGate.scan(data)` reads only the 9-byte frame headers in the byte stream (after the
24-byte client preface) and skips each payload, so it costs a few microseconds a frame. It
says how much of `data` h2 may parse: all of it, or the frames before the one that broke a
limit (then it raises `LimitError` with what to tell the peer). What it counts:

- the preface: done once the client's magic and its first SETTINGS frame have arrived;
- header blocks: a HEADERS frame without END_HEADERS opens one, CONTINUATIONs grow it; its
  size (as sent, HPACK-compressed) is capped, and `header_block_since` says since when one
  has been open, for the connection's header timeout;
- streams that did no work: a stream the peer resets within `PREMATURE` seconds of opening
  it, and a stream the connection refused at once (over the streams limit, or draining).
  CVE-2023-44487 ("rapid reset") opens and resets streams as fast as the wire allows; a peer
  that has opened `min_streams_judged` streams of which more than half did no work is told
  to calm down (Envoy's premature-reset rule, loom/server/boundary/config.py);
- control frames (PING, SETTINGS, WINDOW_UPDATE, PRIORITY, and DATA without payload nor
  END_STREAM): each costs a token from a bucket of `control_frame_burst`, refilled at
  `control_frames_per_second`, and by `CONTROL_FRAMES_PER_SEND` for each frame of work the
  server sends the peer (answers to a flood cost the server, answers to a reader's acks
  do not).

    data:   [preface 24][hdr 9|SETTINGS][hdr 9|HEADERS ...][hdr 9|RST_STREAM][hdr 9|PI
    scan:    magic       preface done    stream 1 opened    stream 1 reset     partial
                                                            (premature)        header kept

A frame header split between two reads is kept until its last byte arrives; a payload split
so is skipped across the reads.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import attrs
from h2.errors import ErrorCodes

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_SIZE = 9
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PING, WINDOW_UPDATE, CONTINUATION = 0x6, 0x8, 0x9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
CONTROL_FRAMES = frozenset({PING, SETTINGS, WINDOW_UPDATE, PRIORITY})
PREMATURE = 1.0  # seconds: a stream reset younger than this did no work (Envoy's default)
CONTROL_FRAMES_PER_SEND = 10  # control frames each frame the server sends pays for (Envoy)


class LimitError(Exception):
    """A limit the peer broke: the connection ends with a GOAWAY of `error_code`, its debug
    data `message`; `cause` is the metrics label."""

    def __init__(self, cause: str, message: str, error_code: ErrorCodes) -> None:
        super().__init__(message)
        self.cause = cause
        self.message = message
        self.error_code = error_code
        self.offset = 0  # from `scan`: the bytes of its data before the breaking frame


@attrs.frozen(kw_only=True)
class GateLimits:
    max_header_bytes: int
    min_streams_judged: int
    control_frame_burst: int
    control_frames_per_second: float


class FrameGate:
    def __init__(self, limits: GateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.preface_left = len(PREFACE)
        self.preface_done = False  # the magic and the first SETTINGS frame have arrived
        self.header = bytearray()  # a frame header still arriving
        self.payload_left = 0  # bytes of the current frame's payload still to skip
        self.header_block_since: float | None = None  # a header block is open since then
        self.header_block_bytes = 0
        self.opened: OrderedDict[int, float] = OrderedDict()  # young streams: when opened
        self.num_streams = 0
        self.num_idle_streams = 0  # reset while young, or refused at once
        self.tokens = float(limits.control_frame_burst)
        self.refilled = clock()

    def scan(self, data: bytes) -> int:
        """How many bytes of `data` h2 may parse; raises `LimitError` when a limit breaks (its
        `offset`: the bytes before the breaking frame)."""
        view, offset = memoryview(data), 0
        if self.preface_left:
            offset = min(self.preface_left, len(data))
            self.preface_left -= offset
        while offset < len(data):
            if self.payload_left:
                step = min(self.payload_left, len(data) - offset)
                self.payload_left -= step
                offset += step
                continue
            step = min(FRAME_HEADER_SIZE - len(self.header), len(data) - offset)
            self.header += view[offset : offset + step]
            offset += step
            if len(self.header) < FRAME_HEADER_SIZE:
                break
            start = offset - FRAME_HEADER_SIZE
            try:
                self.frame(bytes(self.header))
            except LimitError as refusal:
                refusal.offset = max(start, 0)
                raise
            finally:
                self.header.clear()
        return len(data)

    def frame(self, header: bytes) -> None:
        length = int.from_bytes(header[:3], "big")
        kind, flags = header[3], header[4]
        stream_id = int.from_bytes(header[5:9], "big") & 0x7FFF_FFFF
        self.payload_left = length
        if kind == SETTINGS and not self.preface_done and not flags & ACK:
            self.preface_done = True
        if kind == HEADERS:
            self.headers(stream_id, flags, length)
        elif kind == CONTINUATION:
            self.grow_header_block(length, flags)
        elif kind == RST_STREAM:
            self.reset(stream_id)
        if kind in CONTROL_FRAMES or (kind == DATA and not length and not flags & END_STREAM):
            self.control_frame(kind)

    def headers(self, stream_id: int, flags: int, length: int) -> None:
        if stream_id not in self.opened:
            self.forget_old_streams()
            self.num_streams += 1
            self.opened[stream_id] = self.clock()
        self.header_block_since, self.header_block_bytes = self.clock(), 0
        self.grow_header_block(length, flags)

    def grow_header_block(self, length: int, flags: int) -> None:
        self.header_block_bytes += length
        limit = self.limits.max_header_bytes
        if self.header_block_bytes > limit:
            raise LimitError(
                "header_too_large",
                f"a header block of over {limit} bytes; the limit is max_header_bytes={limit}",
                ErrorCodes.ENHANCE_YOUR_CALM,
            )
        if flags & END_HEADERS:
            self.header_block_since = None

    def reset(self, stream_id: int) -> None:
        opened = self.opened.pop(stream_id, None)
        if opened is not None and self.clock() - opened < PREMATURE:
            self.did_no_work()

    def did_no_work(self, stream_id: int | None = None) -> None:
        """A stream reset young, or refused at once; past the rule, calm down."""
        if stream_id is not None:
            self.opened.pop(stream_id, None)
        self.num_idle_streams += 1
        judged = self.limits.min_streams_judged
        if self.num_streams >= judged and 2 * self.num_idle_streams > self.num_streams:
            raise LimitError(
                "rapid_reset",
                f"{self.num_idle_streams} of {self.num_streams} streams reset or refused "
                f"before doing any work (judged from min_streams_judged={judged})",
                ErrorCodes.ENHANCE_YOUR_CALM,
            )

    def forget_old_streams(self) -> None:
        horizon = self.clock() - PREMATURE
        while self.opened and next(iter(self.opened.values())) < horizon:
            self.opened.popitem(last=False)

    def control_frame(self, kind: int) -> None:
        now = self.clock()
        burst = self.limits.control_frame_burst
        self.tokens = min(
            burst, self.tokens + (now - self.refilled) * self.limits.control_frames_per_second
        )
        self.refilled = now
        self.tokens -= 1
        if self.tokens < 0:
            raise LimitError(
                "control_flood",
                f"over control_frame_burst={burst} control frames (PING, SETTINGS, "
                f"WINDOW_UPDATE, PRIORITY, empty DATA) beyond "
                f"control_frames_per_second={self.limits.control_frames_per_second}",
                ErrorCodes.ENHANCE_YOUR_CALM,
            )

    def sent(self, num_frames: int) -> None:
        """The server sent the peer `num_frames` frames of work (HEADERS, DATA)."""
        burst = self.limits.control_frame_burst
        self.tokens = min(burst, self.tokens + num_frames * CONTROL_FRAMES_PER_SEND)
