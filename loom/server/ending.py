"""How a client request ends, the same for both fronts: a gRPC call (loom/server/grpc/call.py)
and an HTTP exchange (loom/server/openai/exchange.py) are each an `Ending`, which the relay
(loom/server/relay.py) and the drain's counts hang their callbacks on. The transport depends on
this, not on the relay."""

from __future__ import annotations

from collections.abc import Callable


class ClientGoneError(Exception):
    """The client stopped reading; its stream was reset."""


class Ending:
    """What a sink's end means, the same for a gRPC call and an HTTP exchange: `when_ended`
    callbacks run once, at the moment it ends (what must not outlive it, an engine request,
    is released there); `arrived` tells the drain, once, that it has reached the engine."""

    def __init__(self) -> None:
        self.ended: str | None = None  # why, once it has
        self.on_end: list[Callable[[], object]] = []
        self.on_arrival: Callable[[], object] | None = None  # the drain counts arrivals

    def run_end(self, why: str) -> bool:
        """It has ended: the callbacks run now. False (and nothing run) if it had already."""
        if self.ended is not None:
            return False
        self.ended = why
        callbacks, self.on_end = self.on_end, []
        for callback in callbacks:
            callback()
        return True

    def when_ended(self, callback: Callable[[], object]) -> None:
        """Run `callback` when it ends (at once, if it has)."""
        if self.ended is not None:
            callback()
        else:
            self.on_end.append(callback)

    def arrived(self) -> None:
        """It has been handed to the engine (or refused by it): once."""
        hook, self.on_arrival = self.on_arrival, None
        if hook is not None:
            hook()
