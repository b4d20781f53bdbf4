"""What a request's head must be to reach the handler, and what a head that is not is told.

Before the handler runs: at most `MAX_HEADER_LINES` header lines (431; the head's bytes are
bounded by h11 as it parses, `max_header_bytes`); not both `Content-Length` and
`Transfer-Encoding` (400: two framings are how requests are smuggled past a proxy that reads
the other, RFC 9112 6.1); and a `Host` the front answers to (400,
loom/server/openai/origin_policy.py). Bytes that are not HTTP/1.1, or a head over its bytes,
are answered by the connection itself (`malformed`): no request exists to hand on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus

import h11

from loom.server.openai.errors import HttpError
from loom.server.openai.message import Body, HttpRequest, Response

MAX_HEADER_LINES = 100  # nginx's large_client_header_buffers allow about as many lines
Handler = Callable[[HttpRequest, Response], Awaitable[None]]


def request_of(event: h11.Request, transport: asyncio.Transport, body: Body) -> HttpRequest:
    """The request a head begins: header names lowercased (h11 has), a repeated header's
    first value."""
    headers: dict[str, str] = {}
    for name, value in event.headers:
        headers.setdefault(name.decode("ascii"), value.decode("latin-1"))
    return HttpRequest(
        method=event.method.decode("ascii"),
        path=event.target.decode("ascii").partition("?")[0],
        headers=headers,
        peer=transport.get_extra_info("peername"),
        cert=transport.get_extra_info("peercert"),
        body=body,
    )


def head_refusal(
    event: h11.Request, headers: Mapping[str, str], host_allowed: Callable[[str | None], bool]
) -> HttpError | None:
    """Why the head is refused; None: it may be served."""
    lines = len(event.headers)
    if lines > MAX_HEADER_LINES:
        return HttpError(
            431,
            f"the request has {lines} header lines; the limit is {MAX_HEADER_LINES}",
            code="max_header_lines",
        )
    if "content-length" in headers and "transfer-encoding" in headers:
        return HttpError(
            400,
            "the request has both Content-Length and Transfer-Encoding",
            code="malformed_request",
        )
    host = headers.get("host")
    if not host_allowed(host):
        return HttpError(
            400,
            f"Host {host!r} is not one this server answers to (--allowed-hosts)",
            param="Host",
            code="host_not_allowed",
        )
    return None


def refusal(error: HttpError) -> Handler:
    """A handler that answers `error` and closes (the body, if any, left unread)."""

    async def refuse(_request: HttpRequest, response: Response) -> None:
        response.close_after = True
        await response.reply(error.status, error.encoded(), error.headers())

    return refuse


def malformed(exc: h11.RemoteProtocolError, max_header_bytes: int) -> HttpError:
    if exc.error_status_hint == 431:
        return HttpError(
            431,
            f"the request's head is over max_header_bytes={max_header_bytes}",
            code="max_header_bytes",
        )
    return HttpError(
        exc.error_status_hint, f"the request is not HTTP/1.1: {exc}", code="malformed_request"
    )


def answer(connection: h11.Connection, error: HttpError) -> bytes:
    """`error` as a whole response that closes the connection, framed by `connection`."""
    body = error.encoded()
    head = h11.Response(
        status_code=error.status,
        reason=HTTPStatus(error.status).phrase,
        headers=[
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ],
    )
    return connection.send(head) + connection.send(h11.Data(data=body))
