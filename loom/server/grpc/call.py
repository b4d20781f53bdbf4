"""One gRPC call on one HTTP/2 stream: what a handler is given, with grpclib's server `Stream`
API (`recv_message`, `async for`, `send_message`, `send_trailing_metadata`, `cancel`,
`deadline`, `metadata`, `peer`, `user_agent`), so grpclib's servicers (health, reflection,
the generated loom.v1 base) run on it unchanged.

Reading (the bytes themselves: loom/server/grpc/inbound.py): a request message is read
whole, as its 5-byte prefix declares: a compressed one is INVALID_ARGUMENT, one over
`max_request_bytes` RESOURCE_EXHAUSTED, unread; the first message must be whole within
`request_timeout` of the stream's start (or by the client's deadline, if sooner:
DEADLINE_EXCEEDED), a later one within `request_timeout` of its prefix. A frame that is cut
short or does not parse is INVALID_ARGUMENT. Once a method that takes one message has it,
the rest of its stream is dropped as it comes.

Ending: a call ends once, by the first of: its trailers sent, a reset either way, the
connection lost. `when_ended` callbacks run at that moment, in the connection's event, before
any task is scheduled: what must not outlive the call (an engine request) is released there,
whatever its handler is doing. A handler still running is then cancelled; every later send
raises StreamTerminatedError and writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import attrs
from google.protobuf.message import DecodeError
from grpclib import GRPCError, Status
from grpclib.exceptions import StreamTerminatedError
from grpclib.metadata import Deadline, encode_grpc_message, encode_metadata
from multidict import MultiDict

from loom.server.boundary import BoundaryConfig
from loom.server.ending import Ending
from loom.server.grpc.frames import CONTENT_TYPE
from loom.server.grpc.inbound import Inbound

PREFIX = struct.Struct(">?I")


def framed(message: Any) -> bytes:
    """A message as gRPC frames it: a compressed flag, its length, its bytes."""
    body: bytes = message.SerializeToString()
    return PREFIX.pack(False, len(body)) + body


class Peer:
    """The client, as grpclib's `Stream.peer` gives it; known once its connection is made."""

    def __init__(self) -> None:
        self.address: Any = None
        self.certificate: dict[str, Any] | None = None

    def addr(self) -> Any:
        """The peer's (host, port)."""
        return self.address

    def cert(self) -> dict[str, Any] | None:
        """The peer's TLS certificate, as `ssl.SSLSocket.getpeercert` gives it (mutual TLS)."""
        return self.certificate


class Sender(Protocol):
    """How a call writes on its connection (loom/server/grpc/outbound.py)."""

    async def send_headers(
        self, call: Call, headers: list[tuple[str, str]], end_stream: bool = False
    ) -> None: ...
    async def send_data(self, call: Call, data: bytes) -> None: ...
    def can_send(self, call: Call, size: int) -> bool: ...
    def write_headers(
        self, call: Call, headers: list[tuple[str, str]], end_stream: bool = False
    ) -> None: ...
    def write_data(self, call: Call, data: bytes) -> None: ...
    def reset(self, call: Call) -> None: ...


@attrs.frozen
class Link:
    """What the calls of one connection have of it."""

    out: Sender
    limits: BoundaryConfig
    refused: Callable[[str], None]  # counts a refusal by the limit that made it
    release: Callable[[Call, str], None]  # the call is over on the connection
    peer: Peer


class Call(Ending):
    def __init__(
        self,
        link: Link,
        stream_id: int,
        path: str,
        method: Any,  # grpclib.const.Handler: func, cardinality, request_type, reply_type
        headers: list[tuple[str, str]],
        deadline: Deadline | None,
        metadata: Any,
        inbound: Inbound,
    ) -> None:
        super().__init__()
        self.link = link
        self.out = link.out
        self.stream_id = stream_id
        self.path = path
        self.method = method
        self.deadline = deadline
        self.metadata = metadata
        self.user_agent = dict(headers).get("user-agent")
        self.peer = link.peer
        self.started = asyncio.get_running_loop().time()
        self.inbound = inbound
        self.window_open = asyncio.Event()
        self.num_received = 0
        self.headers_sent = False
        self.trailers_sent = False
        self.task: asyncio.Task[None] | None = None
        self.tenant: Any = None  # whose call it is (loom/server/tenants.py), named before it runs

    # What the connection tells the call.

    def end(self, why: str) -> bool:
        """The call is over (idempotent): callbacks run now, a running handler is cancelled.
        False if it had ended already."""
        if self.ended is not None:
            return False
        self.inbound.call_ended(why)
        self.run_end(why)
        self.window_open.set()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
        return True

    def release(self, why: str) -> None:
        """The call is over on its connection (its handler may still be finishing)."""
        self.link.release(self, why)

    def check_open(self) -> None:
        if self.ended is not None:
            raise StreamTerminatedError(self.ended)

    # Reading.

    async def recv_message(self) -> Any:
        """The next request message, or None at the end of the client's messages. The first
        must be whole within `request_timeout` of the stream's start; a later one, within
        `request_timeout` of its prefix."""
        limit = self.link.limits.request_timeout
        first = self.num_received == 0
        async with self.in_time(self.started + limit if first else None):
            prefix = await self.inbound.read(PREFIX.size)
        if not prefix:
            return None
        compressed, size = PREFIX.unpack(prefix)
        if compressed:
            raise GRPCError(
                Status.INVALID_ARGUMENT, "compressed request messages are not supported"
            )
        self.check_size(size)
        try:
            loop = asyncio.get_running_loop()
            async with self.in_time(self.started + limit if first else loop.time() + limit):
                body = await self.inbound.read(size)
        finally:
            self.inbound.give_back()
        if len(body) < size:
            raise GRPCError(Status.INVALID_ARGUMENT, "the request message is cut short")
        self.num_received += 1
        if not self.method.cardinality.client_streaming:
            self.inbound.discard()  # its one message is read: more would only sit in memory
        try:
            return self.method.request_type.FromString(body)
        except DecodeError as exc:
            raise GRPCError(
                Status.INVALID_ARGUMENT, f"the request message does not parse: {exc}"
            ) from exc

    def check_size(self, size: int) -> None:
        limit = self.link.limits.max_request_bytes
        if size > limit:
            self.link.refused("max_request_bytes")
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"the request message has {size} bytes; the limit is max_request_bytes={limit}",
            )

    @contextlib.asynccontextmanager
    async def in_time(self, due: float | None) -> AsyncIterator[None]:
        """The block, by `due` (loop time) and by the client's deadline, whichever comes
        first: DEADLINE_EXCEEDED for the client's, RESOURCE_EXHAUSTED for the server's."""
        loop = asyncio.get_running_loop()
        client_due = None
        if self.deadline is not None:
            client_due = loop.time() + self.deadline.time_remaining()
        dues = [d for d in (due, client_due) if d is not None]
        try:
            async with asyncio.timeout_at(min(dues) if dues else None):
                yield
        except TimeoutError:
            if client_due is not None and (due is None or client_due <= due):
                raise GRPCError(
                    Status.DEADLINE_EXCEEDED, "the deadline passed before the request came"
                ) from None
            self.link.refused("request_timeout")
            limit = self.link.limits.request_timeout
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"no whole request message within request_timeout={limit} s",
            ) from None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        message = await self.recv_message()
        if message is None:
            raise StopAsyncIteration
        return message

    # Writing.

    async def send_initial_metadata(self, *, metadata: Any = None) -> None:
        if self.headers_sent:
            raise RuntimeError("initial metadata was already sent")
        headers = [(":status", "200"), ("content-type", CONTENT_TYPE)]
        headers += encode_metadata(MultiDict(metadata or ()))
        await self.out.send_headers(self, headers)
        self.headers_sent = True

    async def send_message(self, message: Any) -> None:
        if not self.headers_sent:
            await self.send_initial_metadata()
        await self.out.send_data(self, framed(message))

    def send_message_nowait(self, message: Any) -> bool:
        """Send `message` at once if the connection can take it whole now (writable, window for
        all of it): True. False when it would have to wait (nothing of it sent then)."""
        data = framed(message)
        if not self.out.can_send(self, len(data)):
            return False
        if not self.headers_sent:
            self.out.write_headers(self, [(":status", "200"), ("content-type", CONTENT_TYPE)])
            self.headers_sent = True
        self.out.write_data(self, data)
        return True

    async def try_send(self, message: Any) -> bool:
        """The relay's way in (loom/server/relay.py `Sink`): `send_message_nowait`."""
        return self.send_message_nowait(message)

    async def send_trailing_metadata(
        self,
        *,
        status: Status = Status.OK,
        status_message: str | None = None,
        status_details: Any = None,
        metadata: Any = None,
    ) -> None:
        """The call's status (trailers-only when nothing was sent before); then, if the client
        is still sending, a RST_STREAM(NO_ERROR) asks it to stop (RFC 9113 §8.1)."""
        if self.trailers_sent:
            raise RuntimeError("trailing metadata was already sent")
        headers = [] if self.headers_sent else [(":status", "200"), ("content-type", CONTENT_TYPE)]
        headers.append(("grpc-status", str(status.value)))
        if status_message is not None:
            headers.append(("grpc-message", encode_grpc_message(status_message)))
        headers += encode_metadata(MultiDict(metadata or ()))
        self.trailers_sent = True
        await self.out.send_headers(self, headers, end_stream=True)

    async def cancel(self) -> None:
        """RST_STREAM(CANCEL): the client learns there is nothing more to expect."""
        self.out.reset(self)
