"""What a connection waits for, and for how long: one timer at a time, for the first of

- its peer to take what it was sent (`write_timeout`, while the transport is paused),
- its preface (`preface_timeout`, from the accept),
- the rest of a header block begun, or of any frame but DATA (`header_timeout`),
- with no stream open, a new stream (`idle_timeout`).

The connection says when its waits began (`first_due` orders them); `rearm` after any change
of those. When the timer fires and the wait is still due, the connection is told which wait
it was (`waited_too_long`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from loom.server.boundary import BoundaryConfig

Due = tuple[float, str]  # when (loop time), and the limit that says so


def first_due(
    config: BoundaryConfig,
    *,
    made_at: float,
    preface_done: bool,
    unfinished_since: float | None,
    paused_since: float | None,
    idle_since: float | None,
) -> Due | None:
    """When a connection open since `made_at` will have waited too long, and for what:
    `paused_since` is when its peer stopped taking what it is sent, `unfinished_since` when a
    header block or frame began that has not ended, `idle_since` when its last stream ended
    (None while a stream is open)."""
    if paused_since is not None:
        return paused_since + config.write_timeout, "write_timeout"
    if not preface_done:
        return made_at + config.preface_timeout, "preface_timeout"
    if unfinished_since is not None:
        return unfinished_since + config.header_timeout, "header_timeout"
    if idle_since is not None:
        return idle_since + config.idle_timeout, "idle_timeout"
    return None


class Watchdog:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        due: Callable[[], Due | None],
        waited_too_long: Callable[[str], None],
    ) -> None:
        self.loop = loop
        self.due = due  # the connection's first wait, now (None: it waits for nothing)
        self.waited_too_long = waited_too_long
        self.timer: asyncio.TimerHandle | None = None
        self.when: float | None = None

    def rearm(self) -> None:
        due = self.due()
        when = due[0] if due else None
        if when == self.when:
            return
        self.stop()
        self.when = when
        if when is not None:
            self.timer = self.loop.call_at(when, self.fire)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.when = None, None

    def fire(self) -> None:
        self.timer, self.when = None, None
        due = self.due()
        if due is None:
            return
        if self.loop.time() < due[0]:
            self.rearm()
            return
        self.waited_too_long(due[1])
