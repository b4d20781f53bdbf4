"""Fair shares between tenants, by weight: whose waiting request is admitted next, whose running
request yields its slot, and how much of the waiting queue a tenant may hold.

Service is counted as the Virtual Token Counter does (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024): each tenant's counter grows by the tokens it is served over its
weight, a computed token counting 1 and a sampled one 1 more (VTC's w_p = 1, w_q = 2); a
constrained token counts its mask's time too, in tokens of the step it was in (`charge`).
Recomputing a preempted request is served again, and counted again.

- Admission takes the next request of the tenant with the lowest counter; within a tenant, the
  lowest `priority`, then the earliest arrival.
- A tenant that becomes backlogged (nothing unfinished before) has its counter lifted to the
  lowest counter among the backlogged ones (VTC's lift): idling saves up no credit. Counters
  never fall, so one at or below that minimum is forgotten when its tenant goes idle (it would
  be lifted anyway), and all are when no tenant is backlogged.
- Running slots: a tenant's share of `max_num_seqs` is its weight over the total weight of the
  tenants with unfinished requests; its usage counts its running requests, paused ones too (a
  client that does not read holds its share). Admission alone cannot take back a slot that a
  long request holds (say, a tenant's 64 streams of 4,000 tokens), so when the slots are full
  and a tenant below its share waits, the newest unpaused request of the tenant furthest above
  its share is preempted (it recomputes later), if that tenant was served more than the
  waiting one by over eight steps of every slot decoding (16 tokens a slot). That margin keeps
  it from thrashing: the waiting tenant, served less, is admitted next; and with fractional
  shares two tenants trade the odd slot at most once every margin's worth of service.
- The waiting queue (loom/engine/queue_share.py): a tenant's share of `max_waiting_requests` is
  its weight over the total weight of the tenants queued, itself included.
- Inside a tenant, its connections share (the second level): admission takes, within the
  tenant, the lowest `priority`, then the connection running the fewest requests, then the
  earliest arrival; and when the slots are full, a request waits, and another connection of
  its tenant runs two or more requests more than its own, that connection's newest request is
  preempted at once (no margin: the tenant's usage does not change, and the two connections
  end a slot apart at most, so nothing thrashes). Streams one connection does not read, or
  floods, never hold a request on another connection of the tenant behind them: two programs
  on one host, or users behind one NAT without keys, are one tenant.

Worked example, max_num_seqs = 4, tenants a (weight 1) and b (weight 3), a running 4 long
requests: b arrives with 6, lifted to a's counter; share_a = 4 * 1/4 = 1, share_b = 3. Once a
was served 64 tokens more than b, a's newest is preempted, then the next, until a holds its
share, 1; b is admitted to the 3 slots freed, before a's preempted ones (b's counter is lower).
b's other 3 are admitted as requests of either end.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator

import attrs

from loom.core.request import Request

PROMPT_WEIGHT = 1.0  # VTC's w_p: a token computed
SAMPLE_WEIGHT = 1.0  # VTC's w_q - w_p: a sampled token costs a computed one and this more
MARGIN_PER_SLOT = 16  # eight steps of every slot decoding (2 a token): see Running slots


def service(num_computed: int, samples: bool) -> float:
    """What computing `num_computed` tokens, and sampling after them or not, is counted."""
    return num_computed * PROMPT_WEIGHT + (SAMPLE_WEIGHT if samples else 0.0)


@attrs.define
class FairShare:
    counters: dict[str, float] = attrs.field(factory=dict)
    weights: dict[str, float] = attrs.field(factory=dict)  # of tenants with unfinished requests
    num_unfinished: Counter[str] = attrs.field(factory=Counter)

    def added(self, tenant: str, weight: float) -> None:
        """A request of `tenant` arrived; a tenant that was idle is lifted."""
        self.weights[tenant] = weight
        if self.num_unfinished[tenant] == 0:
            floor = min((self.counters[t] for t in self.backlogged()), default=0.0)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.num_unfinished[tenant] += 1

    def finished(self, tenant: str) -> None:
        self.num_unfinished[tenant] -= 1
        if self.num_unfinished[tenant] > 0:
            return
        del self.num_unfinished[tenant]
        del self.weights[tenant]
        if not self.num_unfinished:
            self.counters.clear()
            return
        floor = min(self.counters[t] for t in self.backlogged())
        idle = [t for t, n in self.counters.items() if n <= floor and t not in self.num_unfinished]
        for t in idle:  # lifted to the floor anyway, were they to come back
            del self.counters[t]

    def backlogged(self) -> Iterable[str]:
        return self.num_unfinished.keys()

    def served(self, tenant: str, num_computed: int, samples: bool) -> None:
        self.charge(tenant, service(num_computed, samples))

    def charge(self, tenant: str, cost: float) -> None:
        """`cost` more weighted tokens of service (`served`, or a constrained token's mask, as
        measured by the engine: loom/engine/engine_core.py); nothing for a tenant with
        nothing unfinished (its counter is gone)."""
        if tenant in self.weights:
            self.counters[tenant] += cost / self.weights[tenant]

    def shares(self, total: int, tenants: Iterable[str]) -> dict[str, float]:
        """`total` split between `tenants` by weight."""
        wanting = set(tenants)
        weight = sum(self.weights[t] for t in wanting)
        return {t: total * self.weights[t] / weight for t in wanting}

    def admission_order(
        self, waiting: Iterable[Request], running: Iterable[Request]
    ) -> Iterator[Request]:
        """The unpaused waiting requests, next to admit first: the least served tenant's, and
        within it by priority, its connections' usage, then arrival. Lazy: what was admitted
        before (its service, counted as it is scheduled) orders what comes next."""
        queues: dict[str, dict[str, list[Request]]] = {}  # tenant -> connection -> requests
        for request in waiting:
            if not request.paused:
                flows = queues.setdefault(request.tenant, {})
                flows.setdefault(request.tenancy.connection, []).append(request)
        for flows in queues.values():  # the next one last, to pop; ties in queue order
            for queue in flows.values():
                queue.sort(key=lambda r: (r.tenancy.priority, r.arrival_time))
                queue.reverse()
        usage = Counter(flow(r) for r in running if not r.paused)
        while queues:
            tenant = min(queues, key=lambda t: self.counters[t])
            flows = queues[tenant]
            connection = min(
                flows,
                key=lambda c: (
                    flows[c][-1].tenancy.priority,
                    usage[tenant, c],
                    flows[c][-1].arrival_time,
                ),
            )
            queue = flows[connection]
            yield queue.pop()
            usage[tenant, connection] += 1
            if not queue:
                del flows[connection]
                if not flows:
                    del queues[tenant]

    def rebalance(
        self, waiting: Iterable[Request], running: list[Request], max_num_seqs: int
    ) -> list[Request]:
        """The running requests to preempt so that waiting tenants below their share of the
        slots get it: only when the slots are full, each the newest unpaused request of the
        tenant furthest above its share, if it was served more than the waiting tenant by
        over the margin (MARGIN_PER_SLOT weighted tokens a slot)."""
        margin = MARGIN_PER_SLOT * max_num_seqs
        num_free = max_num_seqs - sum(not r.paused for r in running)
        wants = Counter(r.tenant for r in waiting if not r.paused)
        if not wants or num_free < 0:
            return []  # (more running than slots, resumed from pauses: none would be freed)
        usage = Counter(r.tenant for r in running)
        shares = self.shares(max_num_seqs, self.backlogged())
        active = [r for r in running if not r.paused]
        victims: list[Request] = []
        if num_free == 0:
            victims = share_connections(waiting, active)
            if victims:
                return victims
        for tenant in sorted(wants, key=lambda t: self.counters[t]):
            num_wanted = min(wants[tenant], math.ceil(shares[tenant] - usage[tenant]))
            for _ in range(max(num_wanted, 0)):
                if num_free > 0:
                    num_free -= 1
                else:
                    over = {
                        t: usage[t] - shares[t]
                        for t in {r.tenant for r in active}
                        if usage[t] - shares[t] > 0
                        and self.counters[t] > self.counters[tenant] + margin
                    }
                    if not over:
                        return victims
                    victim_tenant = max(over, key=lambda t: over[t])
                    victim = max(
                        (r for r in reversed(active) if r.tenant == victim_tenant),
                        key=lambda r: r.arrival_time,
                    )
                    active.remove(victim)
                    usage[victim_tenant] -= 1
                    victims.append(victim)
                usage[tenant] += 1
        return victims


def flow(request: Request) -> tuple[str, str]:
    """The second level's key: a request's tenant and its connection."""
    return request.tenant, request.tenancy.connection


def share_connections(waiting: Iterable[Request], active: list[Request]) -> list[Request]:
    """With the slots full: the running requests to preempt so that, inside each tenant, a
    waiting request's connection runs no fewer than a connection of its tenant running two or
    more requests more (see the module's last point)."""
    usage = Counter(flow(r) for r in active)  # running, and the slots already given
    held = Counter(usage)  # running: what can be preempted
    wants = Counter(flow(r) for r in waiting if not r.paused)
    victims: list[Request] = []
    for mine in sorted(wants, key=lambda k: usage[k]):
        for _ in range(wants[mine]):
            rivals = [k for k in held if k[0] == mine[0] and k != mine and held[k]]
            most = max(rivals, key=lambda k: usage[k], default=None)
            if most is None or usage[most] <= usage[mine] + 1:
                break
            newest = (r for r in reversed(active) if flow(r) == most)  # ties: the last admitted
            victim = max(newest, key=lambda r: r.arrival_time)
            active.remove(victim)
            victims.append(victim)
            held[most] -= 1
            usage[most] -= 1
            usage[mine] += 1
    return victims
