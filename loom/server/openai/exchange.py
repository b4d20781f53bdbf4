"""One HTTP request and its response: the relay's sink (loom/server/relay.py `Sink`) on an
HTTP/1.1 connection (loom/server/openai/connection.py).

The response's head goes out with its first message, so that an error found before anything
was framed (a refusal after tokenising, a deadline passed in the queue) is a plain HTTP status.
A message is sent at once while the connection's write buffer is below its mark; else
`send_message` waits for the client to read. `cancel` closes the connection: the client learns
that nothing more is coming. A lost connection runs the `when_ended` callbacks at once (the
front calls `lost`), before the handler is cancelled.

What the request says: `X-Request-Id` (a label: echoed, the response's `id`, what a gRPC Abort
names; the server makes one when absent), `X-Request-Timeout` (seconds: the request's deadline,
queued or running; 408 when it passes), and a JSON body read whole within `request_timeout`,
at most `max_request_bytes` (413 beyond, refused unread when its Content-Length says so), its
bytes held against the server's request budget (`max_buffered_request_bytes`, shared with the
gRPC port: 503 when full) until parsed, off the I/O thread where it is large
(loom/server/openai/json_body.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from loom.server.boundary import MAX_REQUEST_ID_CHARS, BoundaryConfig
from loom.server.ending import Ending
from loom.server.openai.errors import HttpError, invalid
from loom.server.openai.json_body import BodyError, Whole, parse, rendered
from loom.server.openai.message import JSON, HttpRequest, Response
from loom.server.traffic import OverBudgetError, RequestBudget, Traffic

T = TypeVar("T")
MAX_TIMEOUT_S = 1e6
SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: pass each event on as it comes
}


class Exchange(Ending):
    def __init__(
        self,
        request: HttpRequest,
        response: Response,
        traffic: Traffic,
    ) -> None:
        super().__init__()
        self.request = request
        self.response = response
        self.arriving = traffic.arriving  # the drain's counts, for both fronts
        self.in_flight = traffic.in_flight
        self.budget = traffic.budget
        self.headers: dict[str, str] = {}
        self.stream = False  # set once the body is read: SSE, or one JSON object

    @property
    def started(self) -> bool:
        return self.response.started

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
        label = self.request.headers.get("x-request-id", "")
        if len(label) > MAX_REQUEST_ID_CHARS:
            raise invalid(
                f"X-Request-Id has {len(label)} characters; the limit is {MAX_REQUEST_ID_CHARS}",
                "X-Request-Id",
            )
        if not (label.isascii() and label.isprintable()):
            raise invalid("X-Request-Id must be printable ASCII", "X-Request-Id")
        return label or uuid.uuid4().hex

    def time_left(self) -> float | None:
        text = self.request.headers.get("x-request-timeout")
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
        return await read_json(self.request, boundary, self.budget, then)

    # The relay's calls

    async def try_send(self, message: bytes | Whole) -> bool:
        if not self.writable():
            return False
        await self.send_message(message)  # aiohttp does not wait below the mark
        return True

    async def send_message(self, message: bytes | Whole) -> None:
        if isinstance(message, Whole):  # a whole response: rendered off the I/O thread
            message = await rendered(message.value)
        if not self.response.started:
            if self.stream:
                await self.response.start(200, {**self.headers, **SSE_HEADERS}, None)
            else:
                await self.response.start(200, {**self.headers, "Content-Type": JSON}, len(message))
        await self.response.write(message)

    async def cancel(self) -> None:
        self.response.abort()

    # The front's calls

    def lost(self) -> None:
        """The connection is gone: the callbacks run now (idempotent)."""
        self.run_end("the connection was lost")

    def writable(self) -> bool:
        return self.response.writable()

    async def finish(self) -> None:
        """The response, ended (a lost connection is no error here)."""
        if not self.response.started:  # a relay given up on its client: nothing more to send
            self.response.close_after = True
            with contextlib.suppress(ConnectionError):
                await self.response.reply(499)
            return
        with contextlib.suppress(ConnectionError):
            await self.response.end()


async def reply_error(
    response: Response, error: HttpError, headers: dict[str, str] | None = None
) -> None:
    """A whole error response."""
    await response.reply(error.status, error.encoded(), {**(headers or {}), **error.headers()})


async def read_json(
    request: HttpRequest, boundary: BoundaryConfig, budget: RequestBudget, then: Callable[[Any], T]
) -> T:
    """The body, read whole within the limits, then parsed as JSON and given to `then` (which
    checks what it holds), off the I/O thread where it is large (json_body.parse). A body that
    does not say it is JSON is refused unread (415): a web page may have any browser send a
    POST of text/plain, a form or no type to another origin without asking it first (no CORS
    preflight), so a Loom on a user's machine would run what any page they visit sends."""
    check_declared(request, boundary.max_request_bytes)
    limit = boundary.max_request_bytes
    body = bytearray()
    try:
        async with asyncio.timeout(boundary.request_timeout):
            while chunk := await request.body.read():
                if len(body) + len(chunk) > limit:
                    raise HttpError(
                        413,
                        f"the body has more than {limit} bytes; the limit "
                        f"is max_request_bytes={limit}",
                        code="request_too_large",
                    )
                budget.take(len(chunk))
                body += chunk
        return await parse(body, then)
    except TimeoutError:
        raise HttpError(
            408,
            f"the body did not arrive within request_timeout={boundary.request_timeout:g} s",
            code="request_timeout",
        ) from None
    except OverBudgetError as exc:
        raise HttpError(503, str(exc), code="max_buffered_request_bytes") from None
    except BodyError as exc:
        raise invalid(f"the body is not valid JSON: {exc}", None) from None
    finally:
        budget.give(len(body))


def check_declared(request: HttpRequest, limit: int) -> None:
    """What the head says of the body: JSON (else 415), at most `limit` bytes (else 413)."""
    if request.content_type != JSON:
        given = request.headers.get("content-type")
        raise HttpError(
            415,
            f"the body's Content-Type is {given!r}; it must be {JSON}"
            if given
            else f"the body has no Content-Type; it must be {JSON}",
            code="unsupported_media_type",
        )
    declared = request.content_length
    if declared is not None and declared > limit:
        raise HttpError(
            413,
            f"the body has {declared} bytes; the limit is max_request_bytes={limit}",
            code="request_too_large",
        )
