"""The traffic ledger and the caps alone, socket-free (loom/server/traffic.py, caps.py): a
phase fanned out to every front, the close in reverse, the request budget naming its limit,
and evictions bounded while their descriptors are still held."""

from __future__ import annotations

import pytest
import trio

from loom.server.boundary import BoundaryConfig
from loom.server.caps import MAX_EVICTING, ConnectionCaps
from loom.server.traffic import DrainPhase, OverBudgetError, RequestBudget, Traffic


class Front:
    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    def enter(self, phase: DrainPhase) -> None:
        self.seen.append(f"{self.name} {phase.value}")

    async def close(self) -> None:
        self.seen.append(f"{self.name} closed")


async def test_ledger_a_phase_reaches_every_front_and_the_close_goes_in_reverse() -> None:
    seen: list[str] = []
    traffic = Traffic(BoundaryConfig())
    traffic.fronts += [Front("grpc", seen), Front("http", seen)]
    traffic.enter(DrainPhase.ANNOUNCED)
    assert not traffic.refusing
    traffic.enter(DrainPhase.REFUSING)
    assert traffic.refusing
    await traffic.close()
    assert traffic.phase is DrainPhase.CLOSED
    assert seen == [
        "grpc announced",
        "http announced",
        "grpc refusing",
        "http refusing",
        "http closed",
        "grpc closed",
    ]


async def test_ledger_a_count_tells_its_waiter_at_zero() -> None:
    traffic = Traffic(BoundaryConfig())
    told: list[int] = []
    traffic.in_flight.add(2)
    traffic.in_flight.when_zero(lambda: told.append(traffic.in_flight.value))
    traffic.in_flight.add(-1)
    assert told == []
    traffic.in_flight.add(-1)
    assert told == [0]
    await trio.lowlevel.checkpoint()


def test_ledger_the_request_budget_refuses_what_it_cannot_cover_and_names_the_limit() -> None:
    budget = RequestBudget(100)
    budget.take(60)
    with pytest.raises(OverBudgetError, match="max_buffered_request_bytes=100"):
        budget.take(41)
    budget.take(40)
    budget.give(100)
    assert budget.taken == 0


def test_ledger_evictions_stop_while_max_evicting_are_still_closing() -> None:
    """An evicted connection's descriptor is freed a loop turn later: at most `MAX_EVICTING`
    at once, so a flood of new connections cannot run the process out of descriptors by
    evicting faster than closes complete."""
    cap = MAX_EVICTING + 4
    caps = ConnectionCaps(BoundaryConfig(max_connections=cap, max_connections_per_peer=cap))
    seats = [caps.take("a") for _ in range(cap)]
    for seat in seats:
        seat.idle()
    made_room = sum(caps.over_cap("b") is None and bool(caps.take("b")) for _ in range(cap))
    assert made_room == MAX_EVICTING
    assert caps.num_evicting == MAX_EVICTING
    refusal = caps.over_cap("b")
    assert refusal is not None
    assert refusal[0] == "max_connections"
    evicted = [seat for seat in seats if seat.evicted]
    evicted[0].release()  # one closed: one more may go
    assert caps.over_cap("b") is None
