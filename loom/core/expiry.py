"""When a request ends by time: its deadline passed (queued or mid-decode), or its consumer read
nothing for `stall_timeout` seconds; and when the next of those comes, for the stepping loop's
sleep."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from loom.core.request import Request, RequestStatus


def expired(
    requests: Iterable[Request], now: float, stall_timeout: float
) -> list[tuple[Request, RequestStatus, str]]:
    """Requests whose deadline passed, or whose consumer stalled past the timeout: each with
    how it ends and why."""
    found = []
    for request in requests:
        if request.deadline is not None and now >= request.deadline:
            where = "while queued" if request.first_scheduled_time is None else "mid-decode"
            error = f"the deadline passed {where}"
            found.append((request, RequestStatus.FINISHED_DEADLINE, error))
        elif request.paused_since is not None and now - request.paused_since >= stall_timeout:
            error = f"the client read nothing for stall_timeout={stall_timeout} s"
            found.append((request, RequestStatus.FINISHED_STALLED, error))
    return found


def next_timer(requests: Collection[Request], stall_timeout: float) -> float:
    """The earliest deadline or stall expiry, or +inf."""
    times = [r.deadline for r in requests if r.deadline is not None]
    times += [r.paused_since + stall_timeout for r in requests if r.paused_since is not None]
    return min(times, default=float("inf"))
