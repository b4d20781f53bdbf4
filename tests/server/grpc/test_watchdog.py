"""The watchdog alone, socket-free: which of a connection's waits comes first, and a timer
that fires only when that wait is still due (loom/server/grpc/watchdog.py)."""

from __future__ import annotations

import asyncio

from loom.server.boundary import BoundaryConfig
from loom.server.grpc.watchdog import Due, Watchdog, first_due

CONFIG = BoundaryConfig(
    write_timeout=60.0, preface_timeout=10.0, header_timeout=5.0, idle_timeout=300.0
)


def due(**waits: float | bool | None) -> Due | None:
    state: dict[str, float | bool | None] = {
        "made_at": 0.0,
        "preface_done": True,
        "unfinished_since": None,
        "paused_since": None,
        "idle_since": None,
    }
    state.update(waits)
    return first_due(CONFIG, **state)  # type: ignore[arg-type]


def test_watchdog_waits_come_in_their_order() -> None:
    assert due(preface_done=False) == (10.0, "preface_timeout")
    assert due(unfinished_since=2.0, idle_since=1.0) == (7.0, "header_timeout")
    assert due(idle_since=1.0) == (301.0, "idle_timeout")
    assert due(paused_since=3.0, preface_done=False) == (63.0, "write_timeout")
    assert due() is None  # a stream open, nothing unfinished: it waits for nothing


def test_watchdog_fires_once_a_wait_is_due_and_not_when_it_ended_meanwhile() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        verdicts: list[str] = []
        waits: dict[str, Due | None] = {"due": (loop.time() + 0.05, "header_timeout")}
        dog = Watchdog(loop, lambda: waits["due"], verdicts.append)
        dog.rearm()
        await asyncio.sleep(0.1)
        waits["due"] = (loop.time() + 0.05, "idle_timeout")
        dog.rearm()
        waits["due"] = None  # the stream came: nothing is due when the timer fires
        await asyncio.sleep(0.1)
        return verdicts

    assert asyncio.run(main()) == ["header_timeout"]
