"""The connection caps: open connections, in all and by peer address, whichever port they
came to, within the descriptor limit, and each connection's place under them (its `Seat`).

The caps stay `FD_RESERVE` below the descriptor limit, whose soft value is first raised to the
hard one (as Go's runtime does at start), so accepting never fails for want of a descriptor.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from collections import Counter
from collections.abc import Callable

from loom.server.boundary import BoundaryConfig

log = logging.getLogger(__name__)
FD_RESERVE = 64  # descriptors left for the model's files, logs, the metrics port, threads
MAX_EVICTING = FD_RESERVE // 2  # evicted connections not yet closed (their descriptors held)


def descriptor_room() -> int:
    """Connections the descriptor limit leaves room for, after raising it to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return max(1, soft - FD_RESERVE)


class Seat:
    """One connection's place under the caps: it says when it carries no request (`idle`:
    then it may be closed to make room, by `evict`) and when it closes (`release`, once)."""

    def __init__(self, caps: ConnectionCaps, host: str) -> None:
        self.caps = caps
        self.host = host
        self.evict: Callable[[], None] | None = None  # the connection's: close now, idle
        self.evicted = False
        self.released = False

    def idle(self) -> None:
        if not (self.released or self.evicted):
            self.caps.idle.pop(self, None)
            self.caps.idle[self] = None  # the newest idle: the last of its peer's evicted

    def busy(self) -> None:
        self.caps.idle.pop(self, None)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.caps.idle.pop(self, None)
        if self.evicted:
            self.caps.num_evicting -= 1
        else:
            self.caps.vacate(self.host)


class ConnectionCaps:
    """Open connections, in all and by peer address, whichever port they came to. At the cap
    in all, a new connection takes the place of a connection that carries no request: the one
    idle the longest of the peer holding the most connections (as nginx and Envoy reuse idle
    keep-alive connections; by peer, so that one holding many idle connections, or opening
    them as fast as they are taken, evicts its own before another's one new connection whose
    request is on its way). It is refused only when every connection is busy, or when
    `MAX_EVICTING` evicted ones have yet to close (their descriptors are freed a loop turn
    later)."""

    def __init__(self, config: BoundaryConfig) -> None:
        self.max_connections = min(config.max_connections, descriptor_room())
        if self.max_connections < config.max_connections:
            log.warning(
                "max_connections lowered to %d: the descriptor limit allows no more",
                self.max_connections,
            )
        self.max_per_peer = config.max_connections_per_peer
        self.num_connections = 0
        self.per_peer = Counter[str]()
        self.idle: dict[Seat, None] = {}  # in the order they became idle
        self.num_evicting = 0

    def over_cap(self, host: str) -> tuple[str, str] | None:
        """The cap a new connection from `host` would exceed, and why; None: within both."""
        limit = self.max_per_peer
        if self.per_peer[host] >= limit:
            return "max_connections_per_peer", (
                f"{host} has {limit} connections open; the limit is "
                f"max_connections_per_peer={limit}"
            )
        if self.num_connections >= self.max_connections and not self.make_room():
            limit = self.max_connections
            return "max_connections", (
                f"the server has {limit} connections open, none idle; the limit is "
                f"max_connections={limit}"
            )
        return None

    def make_room(self) -> bool:
        """Evict an idle connection; False if none is idle."""
        if not self.idle or self.num_evicting >= MAX_EVICTING:
            return False
        seat = max(self.idle, key=lambda s: self.per_peer[s.host])  # ties: idle the longest
        del self.idle[seat]
        seat.evicted = True
        self.num_evicting += 1
        self.vacate(seat.host)
        if seat.evict is not None:
            seat.evict()
        return True

    def take(self, host: str) -> Seat:
        self.num_connections += 1
        self.per_peer[host] += 1
        return Seat(self, host)

    def vacate(self, host: str) -> None:
        self.num_connections -= 1
        self.per_peer[host] -= 1
        if not self.per_peer[host]:
            del self.per_peer[host]
