"""What must hold after every scenario, checked from outside through the server's own RPCs.

- Idle: within `settle_timeout` no request runs, waits or is paused, and every KV block is
  free (empty, or cached and evictable): nothing leaked.
- Health: the standard health service still says SERVING.
- Service: the well-behaved request is answered within `probe_timeout`, with the very tokens
  it got on the idle server before the first scenario (greedy, alone: deterministic).
"""

from __future__ import annotations

import asyncio
from typing import Any

import attrs

from loom.bench.fronts import one_request
from loom.chaos.clients import Target
from loom.chaos.scenarios import PROBE, PROBE_TOKENS


@attrs.frozen(kw_only=True)
class Limits:
    settle_timeout: float = 30.0
    probe_timeout: float = 30.0


async def probe_tokens(target: Target, seconds: float) -> list[int]:
    """The probe's tokens (loom/chaos/scenarios.py), within `seconds`."""
    ids: list[int] = []
    async with target.channel() as channel:
        timing = await asyncio.wait_for(one_request(channel, PROBE, PROBE_TOKENS, ids), seconds)
    if not timing.ok:
        raise RuntimeError(timing.error)
    return ids


async def check(target: Target, expected: list[int], limits: Limits) -> list[str]:
    problems = []
    stats = await target.stats_until(is_idle, limits.settle_timeout)
    if not is_idle(stats):
        held = stats.num_total_blocks - stats.num_free_blocks
        problems.append(
            f"not idle {limits.settle_timeout:g} s after: {stats.num_running} running, "
            f"{stats.num_waiting} waiting, {stats.num_paused} paused, "
            f"{held} of {stats.num_total_blocks} blocks held"
        )
    if (status := await target.health()) != "SERVING":
        problems.append(f"health says {status}, not SERVING")
    try:
        got = await probe_tokens(target, limits.probe_timeout)
    except Exception as exc:  # a finding, named
        problems.append(f"the well-behaved request failed: {type(exc).__name__}: {exc}")
        return problems
    if got != expected:
        problems.append(f"the well-behaved request got {got}, not {expected} as when idle")
    return problems


def is_idle(stats: Any) -> bool:
    busy = stats.num_running or stats.num_waiting or stats.num_paused
    return not busy and stats.num_free_blocks == stats.num_total_blocks
