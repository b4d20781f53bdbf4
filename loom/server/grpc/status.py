"""Engine errors and early ends as gRPC statuses: the one place they are mapped (the table:
docs/architecture.md, "Invariants")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from grpclib import GRPCError, Status
from grpclib.exceptions import StreamTerminatedError

from loom.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from loom.core.request_output import FinishReason
from loom.server.ending import ClientGoneError

log = logging.getLogger(__name__)

ABNORMAL_STATUS = {
    FinishReason.DEADLINE: Status.DEADLINE_EXCEEDED,
    FinishReason.STALLED: Status.RESOURCE_EXHAUSTED,
    FinishReason.REFUSED: Status.RESOURCE_EXHAUSTED,
    FinishReason.ERROR: Status.UNAVAILABLE,
    FinishReason.ABORTED: Status.CANCELLED,
}


@contextmanager
def status_errors() -> Iterator[None]:
    """Engine errors as gRPC statuses; anything else is a bug: INTERNAL."""
    try:
        yield
    except InvalidRequestError as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from exc
    except EngineOverloadedError as exc:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from exc
    except EngineDeadError as exc:
        raise GRPCError(Status.UNAVAILABLE, str(exc)) from exc
    except (GRPCError, ClientGoneError, StreamTerminatedError, asyncio.CancelledError):
        raise  # a status already, or the call is over
    except Exception as exc:  # its message stays in the log: it may hold another client's data
        log.exception("internal error")
        raise GRPCError(
            Status.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"
        ) from exc
