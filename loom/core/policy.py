"""The scheduling policy (`scheduling_policy`): one object that says, for the scheduler and the
engine's admission, everything that differs between the policies.

    fcfs      admission by arrival; a victim of blocks, the latest admitted
    priority  admission by `priority` (lower first), then arrival; a victim, the lowest priority
    fair      tenants share by weight (loom/core/fair_share.py): admission, victims, preemptions
              that give a waiting tenant its share of the slots, and the waiting queue

Each answers: the order to admit waiting requests in (`admission_order`, lazy: what is
admitted first is counted before the next is chosen), the running requests to preempt so that
the slots are shared (`rebalance`), which running request gives up its blocks when a step runs
out (`victim_key`: the greatest), which constrained rows go first under the step's mask budget
(`mask_key`: the least, loom/core/mask_budget.py), and whether the waiting queue is shared by
tenant (`shares_queue`, loom/engine/queue_share.py). Paused requests are never admitted, and are
the first victims whatever the policy (loom/core/scheduler.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from loom.core.block_manager import BlockManager
from loom.core.fair_share import FairShare
from loom.core.request import Request


class Policy(Protocol):
    shares_queue: bool

    def admission_order(
        self, waiting: Iterable[Request], running: Iterable[Request]
    ) -> Iterator[Request]: ...
    def rebalance(
        self, waiting: Iterable[Request], running: list[Request], max_num_seqs: int
    ) -> list[Request]: ...
    def victim_key(self, request: Request) -> tuple[float, int]: ...
    def mask_key(self, request: Request) -> float: ...


class FirstCome:
    shares_queue = False

    def admission_order(
        self, waiting: Iterable[Request], running: Iterable[Request]
    ) -> Iterator[Request]:
        yield from [r for r in waiting if not r.paused]  # as it stands at the first `next`

    def rebalance(
        self, waiting: Iterable[Request], running: list[Request], max_num_seqs: int
    ) -> list[Request]:
        return []

    def victim_key(self, request: Request) -> tuple[float, int]:
        return (0.0, 0)  # all alike: the latest admitted goes

    def mask_key(self, request: Request) -> float:
        return 0.0


class ByPriority(FirstCome):
    def admission_order(
        self, waiting: Iterable[Request], running: Iterable[Request]
    ) -> Iterator[Request]:
        ready = [r for r in waiting if not r.paused]
        yield from sorted(ready, key=lambda r: (r.tenancy.priority, r.arrival_time))

    def victim_key(self, request: Request) -> tuple[float, int]:
        return (request.tenancy.priority, 0)

    def mask_key(self, request: Request) -> float:
        return request.tenancy.priority


class Fair:
    shares_queue = True

    def __init__(self, share: FairShare) -> None:
        self.share = share

    def admission_order(
        self, waiting: Iterable[Request], running: Iterable[Request]
    ) -> Iterator[Request]:
        return self.share.admission_order(waiting, running)

    def rebalance(
        self, waiting: Iterable[Request], running: list[Request], max_num_seqs: int
    ) -> list[Request]:
        return self.share.rebalance(waiting, running, max_num_seqs)

    def victim_key(self, request: Request) -> tuple[float, int]:
        """The most served tenant's, then its lowest priority."""
        return (self.share.counters[request.tenant], request.tenancy.priority)

    def mask_key(self, request: Request) -> float:
        """The least served tenant's first."""
        return self.share.counters.get(request.tenant, 0.0)


def policy_named(name: str, share: FairShare) -> Policy:
    """The policy a `scheduling_policy` names (its choices are these three)."""
    policies: dict[str, Policy] = {
        "fcfs": FirstCome(),
        "priority": ByPriority(),
        "fair": Fair(share),
    }
    return policies[name]


def victim_of(candidates: list[Request], policy: Policy) -> Request:
    """The running request to give up its blocks: the one paused the longest, whatever the
    policy; else the policy's greatest `victim_key`, ties going to the latest admitted."""
    paused = [r for r in candidates if r.paused_since is not None]
    if paused:
        return min(paused, key=lambda r: r.paused_since or 0.0)
    return max(reversed(candidates), key=policy.victim_key)


def make_room(
    blocks: BlockManager,
    request_id: str,
    num_tokens: int,
    cached: list[int],
    running: list[Request],
    policy: Policy,
    preempt: Callable[[Request], None],
) -> bool:
    """Whether blocks for `num_tokens` of a waiting request (with its `cached` prefix) are
    free, after preempting paused requests of `running` if that frees enough (and only then),
    the longest paused first."""

    def short() -> int:  # blocks lacking
        return blocks.num_blocks_needed(request_id, num_tokens, cached) - blocks.num_free_blocks

    if short() <= 0:
        return True  # the common case, without looking through the running requests
    paused = [r for r in running if r.paused]
    if short() > num_freeable(blocks, paused, cached):
        return False
    while paused and short() > 0:
        victim = victim_of(paused, policy)  # all paused: the longest paused
        paused.remove(victim)
        preempt(victim)
    return short() <= 0


def num_freeable(blocks: BlockManager, paused: list[Request], cached: list[int]) -> int:
    """Blocks that preempting all of `paused` would free for a request taking `cached`: those
    that no one else holds (a block shared with a running request stays held, and one of the
    request's own prefix would be taken again)."""
    holders = Counter(b for r in paused for b in blocks.block_table(r.request_id))
    keep = set(cached)
    return sum(blocks.ref_count(b) == n and b not in keep for b, n in holders.items())
