"""The waiting queue shared by weight (loom/engine/queue_share.py), alone: no engine, a queue
of made-up requests."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest

from loom.core.errors import EngineOverloadedError
from loom.core.request import Request
from loom.core.tenancy import Tenancy
from loom.engine.queue_share import QueueShare
from tests.support.factory import make_request


def queue_of(counts: dict[str, int], weights: dict[str, float]) -> list[Request]:
    return [
        attrs.evolve(
            make_request(f"{t}{i}"),
            tenancy=Tenancy(tenant=t, weight=weights[t]),
            arrival_time=float(i),
        )
        for t, n in counts.items()
        for i in range(n)
    ]


def submit(queue: list, tenancy: Tenancy, limit: int) -> str:  # type: ignore[type-arg]
    """One submission: "refused", "taken" (a place was free) or "pushed" (another's place)."""
    share, queued = QueueShare.of(limit, queue, (), tenancy)
    try:
        share.check(tenancy.tenant, queued)
        if queued.total() >= limit:
            queue.remove(share.victim(tenancy.tenant, queued, queue))
            outcome = "pushed"
        else:
            outcome = "taken"
    except EngineOverloadedError:
        return "refused"
    queue.extend(queue_of({tenancy.tenant: 1}, {tenancy.tenant: tenancy.weight}))
    return outcome


def test_queue_share_fractional_shares_do_not_push_each_other_out_in_turn() -> None:
    """Weights 1 and 2 of 10 places (shares 3.33 and 6.67), each tenant submitting in turn:
    b pushes its way to 6 (a seventh would put it above its share), a keeps 4 (it would fall
    below its share without one), and no request is pushed out once the queue has settled."""
    a, b = Tenancy(tenant="a", weight=1.0), Tenancy(tenant="b", weight=2.0)
    queue = queue_of({"a": 10}, {"a": 1.0})  # a alone filled it
    outcomes = [submit(queue, t, 10) for _ in range(20) for t in (a, b)]
    assert Counter(r.tenant for r in queue) == {"a": 4, "b": 6}
    assert Counter(outcomes) == {"pushed": 6, "refused": 34}
    assert "pushed" not in outcomes[12:]


def test_queue_share_refuses_naming_only_the_callers_tenant() -> None:
    queue = queue_of({"secret-tenant": 5, "me": 5}, {"secret-tenant": 1.0, "me": 1.0})
    with pytest.raises(EngineOverloadedError) as refused:
        submit_or_raise(queue, Tenancy(tenant="me"), 10)
    assert "'me' holds 5" in str(refused.value)
    assert "secret-tenant" not in str(refused.value)


def submit_or_raise(queue: list, tenancy: Tenancy, limit: int) -> None:  # type: ignore[type-arg]
    share, queued = QueueShare.of(limit, queue, (), tenancy)
    share.check(tenancy.tenant, queued)
