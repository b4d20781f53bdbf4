"""A call's request, read as Loom needs it (on the streams LoomHandler prepares,
loom/server/grpclib_server.py): its deadline kept out of grpclib's hands, its message capped
in size before its body is read, and a frame that is cut short, compressed or does not parse
answered INVALID_ARGUMENT."""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import DecodeError
from grpclib import GRPCError, Status
from grpclib.metadata import Deadline
from grpclib.server import Stream

MALFORMED = object()


def capped(recv_data: Callable[[int], Awaitable[bytes]], limit: int) -> Callable[..., Any]:
    async def recv(size: int) -> bytes:
        if size > limit:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"the request message has {size} bytes; the limit is max_request_bytes={limit}",
            )
        return await recv_data(size)

    return recv


def deadline_of(stream: Stream[Any, Any]) -> Deadline | None:
    """The client's deadline for a call, if it set one."""
    deadline: Deadline | object | None = getattr(stream._stream, "loom_deadline", None)
    if not (deadline is None or isinstance(deadline, Deadline)):
        raise GRPCError(Status.INVALID_ARGUMENT, "the grpc-timeout header is malformed")
    return deadline


async def recv_request(stream: Stream[Any, Any]) -> Any:
    """`stream.recv_message()`, a frame that is cut short, compressed or does not parse
    answered INVALID_ARGUMENT (grpclib's own reading answers UNKNOWN or serves what it got)."""
    header = await recv_exactly(stream, 5)
    if not header:
        return None
    compressed, size = struct.unpack(">?I", header)
    if compressed:
        raise GRPCError(Status.INVALID_ARGUMENT, "compressed request messages are not supported")
    body = await recv_exactly(stream, size)  # capped: see LoomHandler
    try:
        return stream._codec.decode(body, stream._recv_type)
    except DecodeError as exc:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"the request message does not parse: {exc}"
        ) from exc


async def recv_exactly(stream: Stream[Any, Any], size: int) -> bytes:
    """`size` bytes of the request, or none at its end."""
    cut_short = GRPCError(Status.INVALID_ARGUMENT, "the request message is cut short")
    try:
        data: bytes = await stream._stream.recv_data(size)
    except AssertionError:  # grpclib's word for a stream that ended mid-frame
        raise cut_short from None
    if data and len(data) != size:
        raise cut_short
    return data
