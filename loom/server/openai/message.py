"""One HTTP/1.1 request as the front's handler sees it, and its response as the handler writes
it; the connection (loom/server/openai/connection.py) parses and frames both on h11.

A request's body is read as it arrives: `Body.read` gives what has come (b"" at its end), and
the connection stops reading the socket while `BODY_CHUNK` bytes wait unread, so a body is held
only as fast as its reader takes it. A response is `start`, `write`s and `end`, or one `reply`;
a `write` waits while the client reads too slowly for the connection's write buffers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any

import attrs
import h11

BODY_CHUNK = 64 * 1024  # a body's bytes that may wait unread before the socket is not read
JSON = "application/json"
STATUSES = {status.value for status in HTTPStatus}
NO_BODY = (204, 304)


class Body:
    """A request's body as it arrives."""

    def __init__(self, taken: Callable[[], None], asked: Callable[[], None]) -> None:
        self.taken = taken  # bytes were read: the connection may read the socket again
        self.asked = asked  # the body is wanted: `100 Continue` when the client waits for it
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.ended = False
        self.gone = False
        self.arrived = asyncio.Event()

    @property
    def full(self) -> bool:
        return self.size >= BODY_CHUNK

    def feed(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        self.arrived.set()

    def end(self) -> None:
        self.ended = True
        self.arrived.set()

    def lose(self) -> None:
        self.gone = True
        self.arrived.set()

    async def read(self) -> bytes:
        """What has come since the last read; b"" once the body has ended."""
        self.asked()
        while not self.chunks and not self.ended:
            if self.gone:
                raise ConnectionError("the connection was lost")
            self.arrived.clear()
            await self.arrived.wait()
        data = b"".join(self.chunks)
        self.chunks.clear()
        self.size = 0
        self.taken()
        return data


@attrs.frozen(kw_only=True)
class HttpRequest:
    method: str
    path: str  # the target without its query
    headers: Mapping[str, str]  # names lowercased; a repeated header's first value
    peer: Any  # the socket's peer address, (host, port, ...)
    cert: Any  # the client's TLS certificate, when it gave one
    body: Body

    @property
    def content_type(self) -> str:
        """The media type, lowercased, without parameters; "" when none is given."""
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    @property
    def content_length(self) -> int | None:
        text = self.headers.get("content-length")
        return int(text) if text is not None else None  # h11 has checked it is digits


Send = Callable[[Any], Awaitable[None]]  # an h11 event or bytes out; waits while paused


class Response:
    """The handler's side of the response: the connection's `send`, whether a write would go
    out at once (`writable`), and `abort` (the connection, cut)."""

    def __init__(
        self,
        send: Send,
        writable: Callable[[], bool],
        abort: Callable[[], None],
        headers: Mapping[str, str],
        body: Body,
        framing: str,
    ) -> None:
        self.send = send
        self.writable = writable
        self.abort = abort
        self.headers = dict(headers)  # every response's (CORS), added to the handler's
        self.body = body  # the request's: a response sent before it has all come closes after
        self.close_after = False  # `Connection: close` (a drain has begun)
        # "chunks": an HTTP/1.1 client, whose body of unknown length goes in chunks (framed
        # here: h11's framing costs 2.5 us a write); "head": a HEAD request's, with no body;
        # "": an HTTP/1.0 client's, ended by the close
        self.framing = framing
        self.chunked = False  # this response's body goes in chunks
        self.status: int | None = None
        self.ended = False
        self.when_lost: list[Callable[[], None]] = []

    @property
    def started(self) -> bool:
        return self.status is not None

    async def start(self, status: int, headers: Mapping[str, str], length: int | None) -> None:
        """The head; without `length`, the body is chunked (HTTP/1.0: ends with the
        connection)."""
        fields = {**self.headers, **headers}
        if status not in NO_BODY and length is not None:
            fields["Content-Length"] = str(length)
        elif status not in NO_BODY and self.framing == "chunks":
            fields["Transfer-Encoding"] = "chunked"
            self.chunked = True
        if self.close_after or not self.body.ended:
            self.close_after = True
            fields["Connection"] = "close"
        self.status = status
        reason = HTTPStatus(status).phrase if status in STATUSES else ""
        head = h11.Response(status_code=status, headers=list(fields.items()), reason=reason)
        await self.send(head)

    async def write(self, data: bytes) -> None:
        if not data or self.framing == "head" or self.status in NO_BODY:
            return
        if self.chunked:
            await self.send(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            await self.send(h11.Data(data=data))

    async def end(self) -> None:
        self.ended = True
        await self.send(h11.EndOfMessage())

    async def reply(
        self, status: int, body: bytes = b"", headers: Mapping[str, str] | None = None
    ) -> None:
        """A whole response (JSON, when it has a body)."""
        fields = {"Content-Type": JSON} if body else {}
        await self.start(status, {**fields, **(headers or {})}, len(body))
        await self.write(body)
        await self.end()

    def lose(self) -> None:
        """The connection is gone: the callbacks run now, once."""
        callbacks, self.when_lost = self.when_lost, []
        for callback in callbacks:
            callback()
