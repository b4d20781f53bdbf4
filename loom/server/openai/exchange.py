"""One HTTP request and its response: the relay's sink (loom/server/relay.py `Sink`) on an
aiohttp connection.

The response's head goes out with its first message, so that an error found before anything
was framed (a refusal after tokenising, a deadline passed in the queue) is a plain HTTP status.
A message is sent at once while the connection's write buffer is below its mark (aiohttp then
writes without waiting); else `send_message` waits for the client to read. `cancel` closes the
connection: the client learns that nothing more is coming. A lost connection runs the
`when_ended` callbacks at once (the front calls `lost`), before the handler is cancelled.

What the request says: `X-Request-Id` (a label: echoed, the response's `id`, what a gRPC Abort
names; the server makes one when absent), `X-Request-Timeout` (seconds: the request's deadline,
queued or running; 408 when it passes), and a JSON body read whole within `request_timeout`,
at most `max_request_bytes` (413 beyond, refused unread when its Content-Length says so),
parsed off the I/O thread where it is large (loom/server/openai/json_body.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from loom.server.boundary.config import BoundaryConfig
from loom.server.bridge import Count
from loom.server.openai.errors import HttpError, invalid
from loom.server.openai.json_body import BodyError, Whole, parse, rendered
from loom.server.relay import Ending
from loom.server.wire import MAX_REQUEST_ID_CHARS

T = TypeVar("T")
MAX_TIMEOUT_S = 1e6
JSON = "application/json"  # the one Content-Type a body may have
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: pass each event on as it comes
}


class Exchange(Ending):
    def __init__(self, request: web.BaseRequest, arriving: Count, in_flight: Count) -> None:
        super().__init__()
        self.request = request
        self.arriving = arriving  # the drain's counts (the endpoint's, for both fronts)
        self.in_flight = in_flight
        self.headers: dict[str, str] = {}
        self.stream = False  # set once the body is read: SSE, or one JSON object
        self.close_after = False  # `Connection: close` (a drain has begun)
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        return self.response is not None

    def counted(self) -> Callable[[], None]:
        """Count a generation request as arriving and in flight; the returned call ends it."""
        self.in_flight.add(1)
        self.arriving.add(1)
        self.on_arrival = lambda: self.arriving.add(-1)

        def done() -> None:
            self.arrived()
            self.in_flight.add(-1)

        return done

    def request_id(self) -> str:
        label = self.request.headers.get("X-Request-Id", "")
        if len(label) > MAX_REQUEST_ID_CHARS:
            raise invalid(
                f"X-Request-Id has {len(label)} characters; the limit is {MAX_REQUEST_ID_CHARS}",
                "X-Request-Id",
            )
        if not (label.isascii() and label.isprintable()):
            raise invalid("X-Request-Id must be printable ASCII", "X-Request-Id")
        return label or uuid.uuid4().hex

    def time_left(self) -> float | None:
        text = self.request.headers.get("X-Request-Timeout")
        if text is None:
            return None
        try:
            seconds = float(text)
        except ValueError:
            seconds = float("nan")
        if not (0 < seconds <= MAX_TIMEOUT_S):
            raise invalid(
                f"X-Request-Timeout must be seconds in (0, {MAX_TIMEOUT_S:g}], got {text!r}",
                "X-Request-Timeout",
            )
        return seconds

    async def read_json(self, boundary: BoundaryConfig, then: Callable[[Any], T]) -> T:
        return await read_json(self.request, boundary, then)

    # The relay's calls

    async def try_send(self, message: bytes | Whole) -> bool:
        if not self.writable():
            return False
        await self.send_message(message)  # aiohttp does not wait below the mark
        return True

    async def send_message(self, message: bytes | Whole) -> None:
        if isinstance(message, Whole):  # a whole response: rendered off the I/O thread
            message = await rendered(message.value)
        if self.response is None:
            self.response = self.head(len(message))
            await self.response.prepare(self.request)
        await self.response.write(message)

    async def cancel(self) -> None:
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    # The front's calls

    def lost(self) -> None:
        """The connection is gone: the callbacks run now (idempotent)."""
        self.run_end("the connection was lost")

    def writable(self) -> bool:
        transport = self.request.transport
        protocol: Any = self.request.protocol
        return transport is not None and not transport.is_closing() and not protocol.writing_paused

    def head(self, size: int) -> web.StreamResponse:
        response = web.StreamResponse(headers=self.headers)
        if self.stream:
            response.headers.update(SSE_HEADERS)
        else:
            response.content_type = "application/json"
            response.content_length = size
        if self.close_after:
            response.force_close()
        return response

    async def finish(self) -> web.StreamResponse:
        """The response, ended (a lost connection is no error here)."""
        if self.response is None:  # a relay given up on its client: nothing more to send
            self.response = web.Response(status=499)
            self.response.force_close()
            return self.response
        with contextlib.suppress(ConnectionError):
            await self.response.write_eof()
        return self.response


async def read_json(
    request: web.BaseRequest, boundary: BoundaryConfig, then: Callable[[Any], T]
) -> T:
    """The body, read whole within the limits, then parsed as JSON and given to `then` (which
    checks what it holds), off the I/O thread where it is large (json_body.parse). A body that
    does not say it is JSON is refused unread (415): a web page may have any browser send a
    POST of text/plain, a form or no type to another origin without asking it first (no CORS
    preflight), so a Loom on a user's machine would run what any page they visit sends."""
    if request.content_type != JSON:  # aiohttp's: lowercased, parameters off, absent as bytes
        given = request.headers.get("Content-Type")
        raise HttpError(
            415,
            f"the body's Content-Type is {given!r}; it must be {JSON}"
            if given
            else f"the body has no Content-Type; it must be {JSON}",
            code="unsupported_media_type",
        )
    limit = boundary.max_request_bytes
    declared = request.content_length
    if declared is not None and declared > limit:
        raise HttpError(
            413,
            f"the body has {declared} bytes; the limit is max_request_bytes={limit}",
            code="request_too_large",
        )
    body = bytearray()
    try:
        async with asyncio.timeout(boundary.request_timeout):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise HttpError(
                        413,
                        f"the body has more than {limit} bytes; the limit "
                        f"is max_request_bytes={limit}",
                        code="request_too_large",
                    )
    except TimeoutError:
        raise HttpError(
            408,
            f"the body did not arrive within request_timeout={boundary.request_timeout:g} s",
            code="request_timeout",
        ) from None
    try:
        return await parse(body, then)
    except BodyError as exc:
        raise invalid(f"the body is not valid JSON: {exc}", None) from None
