"""The scheduling policies alone (loom/core/policy.py): each one's admission order and victim,
on requests made by hand."""

from __future__ import annotations

from loom.core.fair_share import FairShare
from loom.core.policy import ByPriority, Fair, FirstCome, policy_named, victim_of
from loom.core.request import Request
from loom.core.sampling_params import SamplingParams
from loom.core.tenancy import Tenancy


def request(name: str, arrival: float, priority: int = 0, tenant: str = "") -> Request:
    return Request(
        request_id=name,
        prompt_token_ids=(1, 2),
        sampling=SamplingParams(max_tokens=4),
        max_tokens=4,
        eos_token_ids=(),
        arrival_time=arrival,
        tenancy=Tenancy(tenant=tenant, priority=priority),
    )


def names(requests: object) -> list[str]:
    return [r.request_id for r in requests]  # type: ignore[attr-defined]


def test_policy_first_come_admits_by_arrival_and_never_a_paused_request() -> None:
    a, b, c = request("a", 1), request("b", 2, priority=-5), request("c", 3)
    b.paused_since = 0.0
    assert names(FirstCome().admission_order([a, b, c], [])) == ["a", "c"]


def test_policy_by_priority_admits_the_lowest_number_first_then_by_arrival() -> None:
    a, b, c = request("a", 1, priority=2), request("b", 2, priority=-1), request("c", 3, priority=2)
    assert names(ByPriority().admission_order([a, b, c], [])) == ["b", "a", "c"]


def test_policy_a_victim_is_the_longest_paused_whatever_the_policy() -> None:
    a, b, c = request("a", 1), request("b", 2), request("c", 3, priority=9)
    b.paused_since, c.paused_since = 5.0, 7.0
    for policy in (FirstCome(), ByPriority(), Fair(FairShare())):
        assert victim_of([a, b, c], policy) is b


def test_policy_victims_without_a_pause() -> None:
    a, b, c = request("a", 1, priority=3), request("b", 2), request("c", 3)
    assert victim_of([a, b, c], FirstCome()) is c  # the latest admitted
    assert victim_of([a, b, c], ByPriority()) is a  # the lowest priority
    share = FairShare()
    for tenant in ("x", "y"):
        share.added(tenant, 1.0)
    share.served("y", 100, samples=True)
    x, y = request("x1", 1, tenant="x"), request("y1", 2, tenant="y")
    assert victim_of([y, x], Fair(share)) is y  # the most served tenant's


def test_policy_each_name_is_its_policy() -> None:
    share = FairShare()
    assert isinstance(policy_named("fcfs", share), FirstCome)
    assert type(policy_named("priority", share)) is ByPriority
    fair = policy_named("fair", share)
    assert isinstance(fair, Fair)
    assert fair.shares_queue
    assert not policy_named("fcfs", share).shares_queue
