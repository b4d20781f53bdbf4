"""The hostile scenarios of `loom chaos`: bare HTTP/2 clients (loom/chaos/attacks.py) against the
server's network boundary, a well-behaved client measured beside the ones that take a while.
Through a proxy (nginx) the proxy's own limits may be what cuts an attacker off: any GOAWAY
or close counts as cut off; only a connection that took the whole attack is a problem.

- rapid-reset: `attack_frames` HEADERS + RST_STREAM pairs on one connection;
- control-flood: `attack_frames` PINGs, then SETTINGS, from a reader; PINGs from a peer that
  reads nothing (the server should stop reading from it, or cut it off);
- slowloris: `hold_connections` connections that never send the HTTP/2 preface;
- header-fragments: as many with a header block begun and never finished, and one whose
  block grows past any sane limit (1 MiB).
The last two wait up to `hold_wait` seconds for the server to close every one of them.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from loom.chaos import attacks
from loom.chaos.scenarios import Result, Run


def cut_off(result: Result, name: str, report: attacks.Report, frames: int) -> None:
    """Count how the attack ended; one that took every frame with the connection open is a
    problem."""
    result.outcomes[f"{name}: {report.cut_off}"] += 1
    result.figures[f"{name}_frames_sent"] = report.sent
    if report.cut_off.seconds is not None:
        result.figures[f"{name}_cut_off_s"] = report.cut_off.seconds
    if report.cut_off.goaway is None and not report.cut_off.closed and report.sent >= frames:
        result.problems.append(f"{name}: the server took all {frames} frames on one connection")


async def rapid_reset(run: Run) -> Result:
    result, target = Result("rapid-reset", clients=1), run.target
    frames = run.settings.attack_frames
    reports: list[attacks.Report] = []

    async def attack() -> None:
        reports.append(
            await asyncio.to_thread(attacks.rapid_reset, target.host, target.port, frames)
        )

    await run.beside(result, attack())
    cut_off(result, "pairs", reports[0], frames)
    return result


async def control_flood(run: Run) -> Result:
    result, target = Result("control-flood", clients=3), run.target
    frames = run.settings.attack_frames
    for kind in ("ping", "settings"):
        report = await asyncio.to_thread(
            attacks.control_flood, target.host, target.port, frames, kind, True
        )
        cut_off(result, kind, report, frames)
    reports: list[attacks.Report] = []

    async def not_reading() -> None:
        reports.append(
            await asyncio.to_thread(
                attacks.control_flood, target.host, target.port, 20 * frames, "ping", False, 3.0
            )
        )

    await run.beside(result, not_reading())
    (report,) = reports
    if report.sent < 20 * frames and report.cut_off.goaway is None:
        result.outcomes["non-reader: the server stopped reading"] += 1
        result.figures["non-reader_frames_sent"] = report.sent
    else:
        cut_off(result, "non-reader", report, 20 * frames)
    return result


async def held_until_closed(
    run: Run, result: Result, make: Callable[[], list[socket.socket]]
) -> None:
    """Open connections with `make`, and wait (`hold_wait` s at most) for the server to close
    each; a well-behaved client is measured meanwhile."""
    socks = await asyncio.to_thread(make)
    result.clients += len(socks)
    closed: list[float | None] = []

    async def wait() -> None:
        closed.extend(await asyncio.to_thread(attacks.when_closed, socks, run.settings.hold_wait))

    await run.beside(result, wait())
    times = [c for c in closed if c is not None]
    result.outcomes["closed by the server"] += len(times)
    if times:
        result.figures["closed_after_s_max"] = max(times)
    if len(times) < len(closed):
        result.outcomes["still open"] += len(closed) - len(times)
        result.problems.append(
            f"{len(closed) - len(times)} of {len(closed)} connections still open after "
            f"{run.settings.hold_wait:g} s"
        )


async def slowloris(run: Run) -> Result:
    result, target = Result("slowloris"), run.target
    count = run.settings.hold_connections
    await held_until_closed(
        run, result, lambda: attacks.silent_connections(target.host, target.port, count)
    )
    return result


async def header_fragments(run: Run) -> Result:
    result, target = Result("header-fragments"), run.target
    count = run.settings.hold_connections

    def make() -> list[socket.socket]:
        socks = attacks.header_fragments(target.host, target.port, count, fragments=4)
        return socks + attacks.header_fragments(target.host, target.port, 1, 64, 16384)

    await held_until_closed(run, result, make)
    return result
