"""Errors as OpenAI's HTTP API gives them, `{"error": {"message", "type", "param", "code"}}`:
the one place where engine errors and early ends become HTTP statuses (the gRPC mapping's
twin, loom/server/grpc/status.py).

    400  a bad value, named with its limit (the engine's own validation) · 401 a bad key
    404  an unknown route or model · 408 the request's deadline passed (X-Request-Timeout)
    413  a body over max_request_bytes · 429 a full queue, a tenant over its share, a queued
    request pushed out (Retry-After) · 499 aborted by an Abort call · 503 loading, draining,
    the engine stopped · 500 a bug, its message in the log only
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

from grpclib import GRPCError, Status

from loom.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from loom.core.request_output import FinishReason, RequestOutput
from loom.server.ending import ClientGoneError

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "aborted_error",
    500: "internal_error",
    503: "service_unavailable_error",
}
FINISHES = {
    FinishReason.DEADLINE: 408,
    FinishReason.STALLED: 429,
    FinishReason.REFUSED: 429,
    FinishReason.ERROR: 503,
    FinishReason.ABORTED: 499,
}
GRPC_STATUSES = {  # what the shared tenant check raises
    Status.UNAUTHENTICATED: 401,
    Status.INVALID_ARGUMENT: 400,
    Status.RESOURCE_EXHAUSTED: 429,
}
FIELD = re.compile(r"[a-z_]+")


class HttpError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, object]:
        kind = TYPES.get(self.status, "invalid_request_error")
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else {}


class StreamEndedError(Exception):
    """A stream that had begun ended with an error; its error event has been sent."""

    def __init__(self, error: HttpError) -> None:
        super().__init__(error.message)
        self.error = error


FROM_MESSAGE = "(the message's first word)"


def invalid(message: str, param: str | None = FROM_MESSAGE) -> HttpError:
    """A bad value: `param` names the field (by default, the message's first word, when it
    is a field's name); None: no one field."""
    if param is FROM_MESSAGE:
        first = message.split(" ", 1)[0].rstrip(":")
        param = first if FIELD.fullmatch(first) else None
    return HttpError(400, message, param=param, code="invalid_value")


def finish_error(last: RequestOutput) -> HttpError:
    """An end that is not a normal finish."""
    status = FINISHES[last.finish_reason]  # type: ignore[index]
    return HttpError(status, last.error or str(last.finish_reason), code=str(last.finish_reason))


@contextmanager
def http_errors() -> Iterator[None]:
    """Engine errors as HttpErrors; anything else is a bug: 500, its message only in the log."""
    try:
        yield
    except InvalidRequestError as exc:
        raise invalid(str(exc)) from exc
    except EngineOverloadedError as exc:
        raise HttpError(429, str(exc), code="overloaded") from exc
    except EngineDeadError as exc:
        raise HttpError(503, str(exc), code="unavailable") from exc
    except GRPCError as exc:
        status = GRPC_STATUSES.get(exc.status, 400)
        raise HttpError(
            status, exc.message or exc.status.name, code=exc.status.name.lower()
        ) from None
    except (HttpError, StreamEndedError, ClientGoneError, asyncio.CancelledError, ConnectionError):
        raise  # an HTTP error already, or the exchange is over
    except Exception as exc:  # its message stays in the log: it may hold another client's data
        log.exception("internal error")
        raise HttpError(
            500, f"internal error ({type(exc).__name__}); see the server log", code="internal"
        ) from exc
