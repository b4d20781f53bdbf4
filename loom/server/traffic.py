"""The traffic ledger: what the server's fronts (the gRPC endpoint, the HTTP front) share, kept
in the I/O thread. One drain phase, the counts the drain waits on, one set of connection caps
(loom/server/caps.py), one budget for the request bytes being received, and the fronts that a
phase change and the close fan out to.

The trio side reads none of it directly: it waits on a count through the I/O thread's handle
(`Io.until_zero`, loom/server/io_thread.py) and enters a phase through it.
"""

from __future__ import annotations

import enum
from typing import Protocol

from loom.server.boundary import BoundaryConfig
from loom.server.bridge import Count
from loom.server.caps import ConnectionCaps


class DrainPhase(enum.Enum):
    """Where the drain is (loom/server/drain.py times them; each front says what they mean)."""

    SERVING = "serving"
    ANNOUNCED = "announced"
    REFUSING = "refusing"
    CLOSED = "closed"


class Front(Protocol):
    """A port's front, as the ledger sees it."""

    def enter(self, phase: DrainPhase) -> None: ...

    async def close(self) -> None: ...


class Traffic:
    """The server's shared counts, made in the I/O thread's loop and used only there."""

    def __init__(self, config: BoundaryConfig) -> None:
        self.caps = ConnectionCaps(config)
        self.budget = RequestBudget(config.max_buffered_request_bytes)
        self.phase = DrainPhase.SERVING
        self.connections = Count()  # client connections open, on every port
        self.unheard = Count()  # told to go away, not yet heard; and the backlog being taken
        self.arriving = Count()  # generation requests admitted, not yet handed to the engine
        self.in_flight = Count()  # generation requests not yet ended (last message sent)
        self.fronts: list[Front] = []

    @property
    def refusing(self) -> bool:
        """New requests are refused (the drain's second phase, or closed)."""
        return self.phase in (DrainPhase.REFUSING, DrainPhase.CLOSED)

    def enter(self, phase: DrainPhase) -> None:
        self.phase = phase
        for front in self.fronts:
            front.enter(phase)

    async def close(self) -> None:
        """Every front closed, the last opened first; their connections with them."""
        self.phase = DrainPhase.CLOSED
        for front in reversed(self.fronts):
            await front.close()


class OverBudgetError(Exception):
    """The request budget has no room; the message names the limit."""


class RequestBudget:
    """Request bytes being received at once, server-wide."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0

    def take(self, size: int) -> None:
        if self.taken + size > self.limit:
            raise OverBudgetError(
                f"the server holds {self.taken} bytes of requests being received; "
                f"{size} more would exceed max_buffered_request_bytes={self.limit}"
            )
        self.taken += size

    def give(self, size: int) -> None:
        self.taken -= size
