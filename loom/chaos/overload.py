"""The overload scenario: several times the queue limit at once, and exactly the excess refused.

Exactness needs the running slots full and busy while the burst is decided, so:
1. fill every running slot (`max_num_seqs`) with a filler: a request as long as the KV pool
   lets all of them be at once (none may be preempted), sent in chunks the queue holds, each
   chunk admitted before the next;
2. send `overload_factor * max_waiting_requests` requests at once, 16 to a connection;
3. once the server has decided each of them (queued ones counted by GetServerStats, refused
   ones by their clients) with every filler still running, exactly `max_waiting_requests` are
   queued (fewer if `max_waiting_tokens` holds fewer prompts) and the rest refused with
   RESOURCE_EXHAUSTED; the fillers are then cancelled ("released"), and every request the
   queue took completes.
If the server's gRPC thread falls behind the fillers' tokens, a filler pauses and gives up
its slot, and a queued request takes it: each such admission lets one more in, and the count is
judged within that many.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from loom.chaos.clients import Behaviour
from loom.chaos.scenarios import Result, Run
from loom.client.calls import server_stats

PROMPT_LEN = 4
MIN_FILL_TOKENS = 16
# The burst's streams share connections: fewer handshakes for client and server (a server
# allows 32 per connection by default; a stream over its limit would be refused).
STREAMS_PER_CONNECTION = 16


async def overload(run: Run) -> Result:
    result, info = Result("overload"), run.target.info
    tokens = await fill_tokens(run)
    if tokens < MIN_FILL_TOKENS:
        result.problems.append(
            f"the KV pool cannot hold max_num_seqs={info.max_num_seqs} requests of "
            f"{MIN_FILL_TOKENS + PROMPT_LEN} tokens: the burst could not be judged exactly"
        )
        return result
    rng, release = random.Random(run.settings.seed + 6), asyncio.Event()
    fillers = [run.message(rng, tokens, PROMPT_LEN) for _ in range(info.max_num_seqs)]
    filling = await fill_slots(run, result, fillers, Behaviour(release=release))
    before = await server_stats(run.target.host, run.target.port, run.target.client)
    burst = run.settings.overload_factor * info.max_waiting_requests
    decided = Result("burst")
    channels = [run.target.channel() for _ in range(0, burst, STREAMS_PER_CONNECTION)]
    calls = [
        (
            run.message(rng, prompt_len=PROMPT_LEN),
            Behaviour(channel=channels[i // STREAMS_PER_CONNECTION]),
        )
        for i in range(burst)
    ]
    bursting = asyncio.ensure_future(run.crowd(decided, calls, at_once=True))
    admitted = await accounted(run, decided, burst, before)
    release.set()
    await asyncio.gather(*filling)
    await bursting
    for channel in channels:
        channel.close()
    judge(result, decided, burst, admitted, queue_limit(run))
    return result


async def fill_tokens(run: Run) -> int:
    """Tokens per filler: as many as fit the context and, for all fillers at once, the pool."""
    info, stats = (
        run.target.info,
        await server_stats(run.target.host, run.target.port, run.target.client),
    )
    per_request = (stats.num_total_blocks - 1) // info.max_num_seqs * info.block_size
    return int(min(per_request, info.max_model_len) - PROMPT_LEN)


def queue_limit(run: Run) -> int:
    info = run.target.info
    return int(min(info.max_waiting_requests, info.max_waiting_tokens // PROMPT_LEN))


async def fill_slots(
    run: Run, result: Result, fillers: list[Any], behaviour: Behaviour
) -> list[asyncio.Future[None]]:
    """Start the fillers, a queue's worth at a time; return once all of them run."""
    tasks: list[asyncio.Future[None]] = []
    chunk = queue_limit(run)
    for start in range(0, len(fillers), chunk):
        calls = [(m, behaviour) for m in fillers[start : start + chunk]]
        tasks.append(asyncio.ensure_future(run.crowd(result, calls, at_once=True)))
        await run.target.stats_until(all_running(start + len(calls)), 60)
    return tasks


def all_running(count: int) -> Callable[[Any], bool]:
    return lambda stats: bool(stats.num_running == count and not stats.num_waiting)


async def accounted(run: Run, decided: Result, burst: int, before: Any) -> int | None:
    """Wait until every burst request is queued, refused or admitted to a running slot: how
    many were admitted (a filler paused: the server's gRPC thread fell behind its tokens, and
    a paused request gives up its slot), or None if that never came to pass within a minute.
    Admissions are read from the prefix cache's query count, which grows by a request's
    tokens whenever one is admitted."""
    queried = before.prefix_cache_queries

    def admitted(stats: Any) -> int:
        return int(stats.prefix_cache_queries - queried) // PROMPT_LEN

    def done(stats: Any) -> bool:
        refused = decided.outcomes["RESOURCE_EXHAUSTED"]
        return bool(stats.num_waiting + refused + admitted(stats) >= burst)

    stats = await run.target.stats_until(done, 60)
    return admitted(stats) if done(stats) else None


def judge(result: Result, decided: Result, burst: int, admitted: int | None, queue: int) -> None:
    """Exactly the excess refused; when fillers paused and `admitted` burst requests took their
    slots, each of those let one more in: between `admitted` fewer and exactly the excess."""
    fillers = result.outcomes.copy()
    result.expect({"released"})  # the fillers
    result.outcomes += decided.outcomes
    result.clients += decided.clients
    decided.expect({"ok", "RESOURCE_EXHAUSTED"})
    result.problems += decided.problems
    refused = decided.outcomes["RESOURCE_EXHAUSTED"]
    result.figures |= {"fillers": sum(fillers.values()), "burst": burst, "refused": refused}
    if admitted is None:
        result.problems.append("the burst was not decided within 60 s")
        return
    result.figures["admitted_during_burst"] = admitted
    excess = burst - queue
    if not excess - admitted <= refused <= excess:
        exactly = "exactly" if not admitted else f"{excess - admitted} to"
        result.problems.append(
            f"{refused} of a burst of {burst} refused; {exactly} {excess} should have been "
            f"(the queue holds {queue}; {admitted} admitted to running meanwhile)"
        )
