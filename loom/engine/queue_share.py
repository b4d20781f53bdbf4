"""The waiting queue shared by weight between tenants (the fair policy; loom/core/fair_share.py
shares the running slots). A tenant's share of `max_waiting_requests` is its weight over the
total weight of the tenants queued, itself included.

- Alone, a tenant may fill the queue.
- While others are queued, a request is taken only if its tenant then holds no more than its
  share; else it is refused, naming the limit.
- When the queue is full, a request of a tenant below its share takes the place of the newest
  never-run request of the tenant furthest above its own, if that tenant still holds its share
  without it (hysteresis: two tenants with fractional shares never push each other out in
  turn). The place is taken when the request is handed to the scheduler, once its prompt has
  been checked, so that a request that fails (or is cancelled) costs no one a place.

Messages name the caller's own tenant and the limits, never another tenant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from loom.core.errors import EngineOverloadedError
from loom.core.request import Request, RequestStatus
from loom.core.tenancy import Tenancy


class QueueShare:
    def __init__(self, limit: int, weights: dict[str, float]) -> None:
        self.limit = limit
        self.weights = weights  # of the tenants queued (and the one asking)

    @classmethod
    def of(
        cls, limit: int, waiting: Iterable[Request], pending: Iterable[Tenancy], asking: Tenancy
    ) -> tuple[QueueShare, Counter[str]]:
        """The shares, and the requests queued by tenant (waiting unpaused, and pending)."""
        queued: Counter[str] = Counter()
        weights = {asking.tenant: asking.weight}
        for request in waiting:
            if not request.paused:
                queued[request.tenant] += 1
                weights.setdefault(request.tenant, request.tenancy.weight)
        for tenancy in pending:
            queued[tenancy.tenant] += 1
            weights.setdefault(tenancy.tenant, tenancy.weight)
        return cls(limit, weights), queued

    def share(self, tenant: str) -> float:
        return self.limit * self.weights[tenant] / sum(self.weights.values())

    def check(self, tenant: str, queued: Counter[str]) -> None:
        """Refuse a request of `tenant` if taking it would put the tenant above its share
        while others are queued, or if the queue is full and no place can be taken for it."""
        num_queued, mine = queued.total(), queued[tenant]
        if num_queued > mine and mine + 1 > self.share(tenant):
            raise EngineOverloadedError(
                f"tenant {tenant!r} holds {mine} of the waiting queue's places, its share while "
                f"others wait (max_waiting_requests={self.limit}, shared by weight)"
            )
        if num_queued >= self.limit and not self.over_share(tenant, queued):
            raise queue_full(num_queued, self.limit)

    def over_share(self, tenant: str, queued: Counter[str]) -> str | None:
        """The tenant furthest above its share, other than `tenant`, that holds its share even
        without one request; None if there is none."""
        over = {
            t: n - self.share(t)
            for t, n in queued.items()
            if t != tenant and n - 1 >= self.share(t)
        }
        return max(over, key=lambda t: over[t], default=None)

    def victim(self, tenant: str, queued: Counter[str], waiting: Iterable[Request]) -> Request:
        """The request whose place a request of `tenant` takes; refused if there is none."""
        over = self.over_share(tenant, queued)
        victims = [
            r
            for r in waiting
            if over is not None and r.tenant == over and r.status is RequestStatus.WAITING
        ]
        if not victims:
            raise queue_full(queued.total(), self.limit)
        return max(victims, key=lambda r: r.arrival_time)


def queue_full(num_queued: int, limit: int, what: str = "requests") -> EngineOverloadedError:
    return EngineOverloadedError(
        f"the waiting queue is full: {num_queued} {what} (max_waiting_requests={limit})"
    )


PUSHED_OUT = (
    "refused: the waiting queue is full, and a tenant below its share took this request's "
    "place (this tenant held more than its share of max_waiting_requests={limit})"
)
