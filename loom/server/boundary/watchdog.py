"""What a connection waits for, and for how long: one timer at a time, for the first of

- its peer to take what it was sent (`write_timeout`, while the transport is paused),
- its preface (`preface_timeout`, from the accept),
- the rest of a header block begun, or of any frame but DATA (`header_timeout`),
- with no stream open, a new stream (`idle_timeout`).

`rearm` after any change of those; when the timer fires and the wait is still due, the
connection is told (`Connection.waited_too_long`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loom.server.boundary.connection import Connection


class Watchdog:
    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.timer: asyncio.TimerHandle | None = None
        self.due: float | None = None

    def next_due(self) -> tuple[float, str] | None:
        """When the connection will have waited too long, and for what."""
        c = self.connection
        if c.closing is not None:
            return None
        config = c.config
        if c.out.paused_since is not None:
            return c.out.paused_since + config.write_timeout, "write_timeout"
        if not c.gate.preface_done:
            return c.made_at + config.preface_timeout, "preface_timeout"
        unfinished = c.gate.unfinished_since
        if unfinished is not None:
            return unfinished + config.header_timeout, "header_timeout"
        if not c.streams.calls and c.idle_since is not None:
            return c.idle_since + config.idle_timeout, "idle_timeout"
        return None

    def rearm(self) -> None:
        due = self.next_due()
        when = due[0] if due else None
        if when == self.due:
            return
        self.stop()
        self.due = when
        if when is not None:
            self.timer = self.connection.loop.call_at(when, self.fire)

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.due = None, None

    def fire(self) -> None:
        self.timer, self.due = None, None
        due = self.next_due()
        if due is None:
            return
        if self.connection.loop.time() < due[0]:
            self.rearm()
            return
        self.connection.waited_too_long(due[1])
