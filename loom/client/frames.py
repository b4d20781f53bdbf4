"""Raw HTTP/2 made by hand, for the clients no gRPC library would let be (the hostile ones of
loom/chaos/attacks.py, the wire tests): frames of any kind and flags on any stream, a gRPC
call's header block that opens any number of streams, a gRPC message's framing, and the
frames a server sent, parsed without a connection's state (h2 takes any frame after a GOAWAY
for an error)."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

from hpack import Encoder, NeverIndexedHeaderTuple
from hyperframe.frame import Frame

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, CONTINUATION = 0, 1, 3, 4, 6, 7, 9
END_STREAM, END_HEADERS = 0x1, 0x4
CANCEL = 0x8
ERROR_CODES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 11: "ENHANCE_YOUR_CALM"}
GENERATE = "/loom.v1.Loom/Generate"
PREFIX = struct.Struct(">?I")  # a gRPC message's: compressed, length


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    header = len(payload).to_bytes(3, "big") + bytes((kind, flags))
    return header + (stream_id & 0x7FFF_FFFF).to_bytes(4, "big") + payload


def request_block(authority: str, path: str = GENERATE) -> bytes:
    """The HPACK header block of a gRPC call that stands alone (never indexed: it adds nothing
    to the dynamic table), so that the same bytes can open any number of streams."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path)]
    headers += [(":authority", authority), ("content-type", "application/grpc"), ("te", "trailers")]
    return bytes(Encoder().encode([NeverIndexedHeaderTuple(k, v) for k, v in headers]))


def grpc_message(message: Any, *, size: int | None = None) -> bytes:
    """A gRPC message as a stream carries it: uncompressed, its length (or `size`, a lie), its
    bytes (a protobuf message, or bytes as they are)."""
    body = message if isinstance(message, bytes) else message.SerializeToString()
    return PREFIX.pack(False, len(body) if size is None else size) + body


def split_frames(data: bytes) -> tuple[list[Frame], bytes]:
    """The whole frames at the start of `data`, and the rest."""
    complete: list[Frame] = []
    while len(data) >= 9:
        parsed, length = Frame.parse_frame_header(memoryview(data[:9]))
        if len(data) < 9 + length:
            break
        parsed.parse_body(memoryview(data[9 : 9 + length]))
        complete.append(parsed)
        data = data[9 + length :]
    return complete, data


def connect(host: str, port: int, source: str | None = None, timeout: float = 10) -> socket.socket:
    """A TCP connection, from the loopback address `source` if given (another peer)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    if source is not None:
        sock.bind((source, 0))
    sock.connect((host, port))
    return sock


def read_frames(sock: socket.socket, seconds: float) -> list[Frame]:
    """Every frame that arrives on `sock` within `seconds`, until the connection closes."""
    seen: list[Frame] = []
    buffer, deadline = b"", time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        complete, buffer = split_frames(buffer + chunk)
        seen += complete
    return seen
