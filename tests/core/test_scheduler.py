"""The scheduler alone: plain Python, driven step by step with made-up sampled tokens."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from loom.core.block_manager import BlockManager
from loom.core.config import SchedulerConfig
from loom.core.expiry import expired, next_timer
from loom.core.request import Request, RequestStatus
from loom.core.sampling_params import SamplingParams
from loom.core.scheduler import Scheduler
from loom.core.step import SchedulerOutput
from loom.core.tenancy import Tenancy
from tests.support.factory import make_request, sampled


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, *, caching: bool = False, **config: Any
) -> Scheduler:
    """Without prefix caching unless asked: these prompts (1, 2, 3, ...) all share prefixes, and
    tests/core/test_prefix_cache.py is where caching's own behaviour is checked."""
    blocks = BlockManager(num_blocks=num_blocks, block_size=block_size, enable_caching=caching)
    return Scheduler(SchedulerConfig(**config), blocks)


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule(now=0.0)
    assert output is not None
    scheduler.update(output, sampled(output), now=0.0)
    return output


def shape(output: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: len(s.token_ids) for s in output.sequences}


def test_scheduler_chunks_a_long_prompt_within_the_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("long", 20))
    assert shape(step(scheduler)) == {"long": 8}
    assert shape(step(scheduler)) == {"long": 8}
    last = step(scheduler)
    assert shape(last) == {"long": 4}
    assert last.sequences[0].sampling is not None  # the whole prompt is in: it samples
    assert scheduler.num_chunked_prefills == 2


def test_scheduler_serves_running_decodes_first_and_prefills_with_what_is_left() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 3))
    step(scheduler)  # both prefill: 3 + 3 tokens
    scheduler.add_request(make_request("c", 20))
    assert shape(step(scheduler)) == {"a": 1, "b": 1, "c": 6}
    assert shape(step(scheduler)) == {"a": 1, "b": 1, "c": 6}


def test_scheduler_respects_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 2))
    assert set(shape(step(scheduler))) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def step_until_preemption(scheduler: Scheduler, max_steps: int = 20) -> SchedulerOutput:
    for _ in range(max_steps):
        before = scheduler.num_preemptions
        output = step(scheduler)
        if scheduler.num_preemptions > before:
            return output
    raise AssertionError("no preemption happened")


def test_scheduler_preempts_the_latest_arrival_when_blocks_run_out() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks
    scheduler.add_request(make_request("old", 4))
    scheduler.add_request(make_request("new", 4))
    output = step_until_preemption(scheduler)
    assert shape(output) == {"old": 1}
    new = scheduler.waiting[0]
    assert new.request_id == "new"
    assert new.status is RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0
    assert new.num_preemptions == 1
    assert scheduler.num_preemptions == 1
    assert not scheduler.block_manager.has_request("new")


def test_scheduler_preempts_paused_requests_first() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, 4))
    step(scheduler)
    scheduler.pause(scheduler.running[0], now=0.0)  # "a", the oldest, stops being read
    output = step_until_preemption(scheduler)
    assert shape(output) == {"b": 1}
    assert [r.request_id for r in scheduler.waiting] == ["a"]
    assert [r.request_id for r in scheduler.running] == ["b"]


def test_scheduler_resumes_a_preempted_request_only_when_all_its_tokens_fit() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 4))
    step_until_preemption(scheduler)
    preempted = scheduler.waiting[0]
    assert preempted.num_tokens == 9  # needs 3 blocks, with room for its next token
    for _ in range(3):
        output = step(scheduler)
        assert "b" not in shape(output)  # "a" holds 3 blocks; only 1 is free
    scheduler.finish(scheduler.running[0], RequestStatus.FINISHED_ABORTED)
    assert shape(step(scheduler)) == {"b": 9}  # prompt + output recomputed in one go


def test_scheduler_admits_nothing_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4)  # 4 usable blocks
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 4))
    step(scheduler)
    scheduler.add_request(make_request("c", 1))
    output = step_until_preemption(scheduler)
    # "a" needed a third block: "b", the latest arrival, was preempted and freed 2 blocks; "a"
    # took one, and "c" would fit in the other, but a step that preempted admits nothing.
    assert shape(output) == {"a": 1}
    assert scheduler.block_manager.num_free_blocks == 1
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


def test_scheduler_a_waiting_request_takes_the_blocks_and_slot_of_paused_ones() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=2)
    scheduler.add_request(make_request("a", 8))  # 2 blocks
    scheduler.add_request(make_request("b", 4))  # 1 block
    step(scheduler)
    scheduler.pause(scheduler.running[0], now=0.0)  # "a"'s consumer stops reading
    scheduler.add_request(make_request("c", 4))
    output = step(scheduler)
    # "a" no longer counts against max_num_seqs=2, and its blocks go to "c".
    assert shape(output) == {"b": 1, "c": 4}
    a = scheduler.requests["a"]
    assert (a.status, a.paused, a.num_computed_tokens) == (RequestStatus.PREEMPTED, True, 0)
    assert scheduler.num_active() == 2
    assert scheduler.num_waiting() == 0  # a paused request does not hold a place in the queue
    assert scheduler.resume("a")
    assert scheduler.num_waiting() == 1


def test_scheduler_never_batches_more_than_max_num_seqs_when_paused_requests_resume() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, 3))
    step(scheduler)
    scheduler.pause(scheduler.requests["a"], now=0.0)
    scheduler.add_request(make_request("c", 3))
    assert set(shape(step(scheduler))) == {"b", "c"}  # "a"'s slot went to "c"
    scheduler.resume("a")  # three running requests for two slots: the latest waits its turn
    assert set(shape(step(scheduler))) == {"a", "b"}
    assert scheduler.num_active() == 3


def test_scheduler_finish_is_idempotent_and_frees_blocks() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 9)
    scheduler.add_request(request)
    step(scheduler)
    assert scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
    assert request.status is RequestStatus.FINISHED_ABORTED
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert not scheduler.has_unfinished()


def test_scheduler_finish_during_a_step_wins_over_the_step() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 3)
    scheduler.add_request(request)
    output = scheduler.schedule(now=0.0)
    assert output is not None
    scheduler.finish(request, RequestStatus.FINISHED_ABORTED)  # lands while the step runs
    assert scheduler.update(output, sampled(output, 5), now=0.0) == []
    assert request.output_token_ids == []
    assert request.status is RequestStatus.FINISHED_ABORTED


def test_scheduler_skips_paused_requests_and_reports_timers() -> None:
    scheduler = make_scheduler()
    request = make_request("a", 3)
    request.deadline = 50.0
    scheduler.add_request(request)
    step(scheduler)
    scheduler.pause(request, now=10.0)
    assert scheduler.schedule(now=11.0) is None
    assert next_timer(scheduler.requests.values(), stall_timeout=5.0) == 15.0
    assert expired(scheduler.requests.values(), now=14.0, stall_timeout=5.0) == []
    assert expired(scheduler.requests.values(), now=15.0, stall_timeout=5.0) == [
        (request, RequestStatus.FINISHED_STALLED, "the client read nothing for stall_timeout=5.0 s")
    ]
    assert scheduler.resume("a")
    assert not scheduler.resume("a")  # not paused any more
    assert expired(scheduler.requests.values(), now=50.0, stall_timeout=5.0) == [
        (request, RequestStatus.FINISHED_DEADLINE, "the deadline passed mid-decode")
    ]


def test_scheduler_update_finishes_on_token_stops_and_frees_their_blocks() -> None:
    scheduler = make_scheduler()
    eos = make_request("eos", 3, eos_token_ids=(7,))
    stop_id = make_request("stop_id", 3, sampling=SamplingParams(stop_token_ids=(7,)))
    held = make_request("held", 3, eos_token_ids=(7,), sampling=SamplingParams(min_tokens=2))
    capped = make_request("capped", 3, max_tokens=2)
    ignoring = make_request(
        "ignoring", 3, eos_token_ids=(7,), sampling=SamplingParams(ignore_eos=True)
    )
    for request in (eos, stop_id, held, capped, ignoring):
        scheduler.add_request(request)
    output = scheduler.schedule(now=1.0)
    assert output is not None
    advanced = scheduler.update(output, sampled(output), now=2.0)
    assert [r.request_id for r, _ in advanced] == ["eos", "stop_id", "held", "capped", "ignoring"]
    assert eos.status is stop_id.status is RequestStatus.FINISHED_STOPPED
    assert held.status is capped.status is ignoring.status is RequestStatus.RUNNING
    assert eos.first_token_time == 2.0
    assert scheduler.block_manager.block_table("eos") == ()  # freed when it finished
    output = scheduler.schedule(now=3.0)
    assert output is not None
    scheduler.update(output, sampled(output), now=3.0)
    assert held.status is RequestStatus.FINISHED_STOPPED  # EOS counts once min_tokens is met
    assert capped.status is RequestStatus.FINISHED_LENGTH
    assert list(scheduler.requests) == ["ignoring"]
    assert scheduler.num_generated_tokens == 8


def test_scheduler_output_carries_only_plain_data_for_the_worker_thread() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", 6, sampling=SamplingParams(seed=3, repetition_penalty=1.5))
    scheduler.add_request(request)
    first = step(scheduler)
    assert first.sequences[0].sampling is None  # a chunk with more prompt to come
    second = step(scheduler)
    (seq,) = second.sequences
    assert seq.token_ids == (5, 6)
    assert seq.sampling is not None
    assert seq.sampling.prompt_token_ids == (1, 2, 3, 4, 5, 6)
    assert seq.sampling.output_token_ids == ()
    third = step(scheduler)
    assert third.sequences[0].sampling is not None
    assert third.sequences[0].sampling.output_token_ids == (7,)  # a copy: later tokens not in it
    assert request.output_token_ids == [7, 7]


@pytest.mark.parametrize("status", list(RequestStatus))
def test_request_status_finished_is_one_comparison(status: RequestStatus) -> None:
    assert status.finished == (status.finish_reason is not None)


@attrs.define
class Costing:
    """A matcher that takes every token, with what its tokens cost its grammar: the figure the
    engine measures (tests/engine/test_mask_budget.py runs real ones)."""

    token_seconds: float
    step_seconds: float = 0.0
    opening: int | None = None

    def consume(self, token_id: int) -> None:
        pass

    def is_stopped(self) -> bool:
        return False

    def error(self) -> str:
        return ""


def constrained(request_id: str, tenant: str, token_seconds: float) -> Request:
    request = make_request(request_id)
    request.tenancy, request.matcher = Tenancy(tenant=tenant), Costing(token_seconds)
    return request


def test_scheduler_mask_budget_least_served_tenant_first_then_longest_out() -> None:
    """Rows of 4 ms masks under a 10 ms budget: two a step. Tenant y (one request) was served
    least, so its row goes every step; x's four take the other place in turn, the one
    longest out of a step first. The rows left out are not dropped: they run when their turn
    comes."""
    scheduler = make_scheduler(step_mask_budget=0.01)
    requests = [constrained(f"x{i}", "x", 0.0) for i in range(4)] + [constrained("y", "y", 0.0)]
    for request in requests:
        scheduler.add_request(request)
    assert len(shape(step(scheduler))) == 5  # prompts: masks measured as costing nothing
    for request in requests:
        assert request.matcher is not None
        request.matcher.token_seconds = 0.004
    assert [set(shape(step(scheduler))) for _ in range(4)] == [
        {"y", "x0"},
        {"y", "x1"},
        {"y", "x2"},
        {"y", "x3"},
    ]


def test_scheduler_charges_a_grammar_s_cost_before_the_token_ends_its_request() -> None:
    """A one-token request of tenant y, its grammar's cost 0.01 s at 1,000 units a second:
    y is charged 10 units before its request ends (charged after, it would have had no
    counter left to charge, and its next request would start where y had been, with what
    its masks cost forgotten); x, which runs on, keeps its own."""
    scheduler = make_scheduler()
    x = make_request("x")
    x.tenancy = Tenancy(tenant="x")
    scheduler.add_request(x)
    scheduler.add_request(constrained("y", "y", 0.0))
    scheduler.requests["y"].max_tokens = 1
    output = scheduler.schedule(now=0.0)
    assert output is not None
    served = dict(scheduler.fair.counters)
    matcher = scheduler.requests["y"].matcher
    assert isinstance(matcher, Costing)
    matcher.step_seconds = 0.01
    scheduler.update(output, sampled(output), now=0.0, rate=1000.0)
    assert "y" not in scheduler.requests
    assert scheduler.fair.counters["y"] == pytest.approx(served["y"] + 10.0)
    assert scheduler.fair.counters["x"] == served["x"]


def test_scheduler_mask_budget_lets_one_row_through_whatever_it_costs() -> None:
    scheduler = make_scheduler(step_mask_budget=0.01)
    scheduler.add_request(constrained("a", "a", 0.0))
    scheduler.add_request(make_request("free"))
    step(scheduler)
    assert scheduler.requests["a"].matcher is not None
    scheduler.requests["a"].matcher.token_seconds = 5.0
    assert shape(step(scheduler)) == {"a": 1, "free": 1}


def test_scheduler_mask_budget_holds_no_tenant_s_new_request_behind_another_s_rows() -> None:
    """Tenant x's two running rows fill the budget; tenant y's new constrained request (y
    arrives at x's counter, and has never been in a step) takes its turn all the same, and
    one of x's rows waits. A free request is never held by the budget."""
    scheduler = make_scheduler(step_mask_budget=0.01)
    for i in range(2):
        scheduler.add_request(constrained(f"x{i}", "x", 0.004))
    step(scheduler)
    step(scheduler)
    scheduler.add_request(constrained("y", "y", 0.004))
    scheduler.add_request(make_request("free"))
    assert shape(step(scheduler)) == {"x0": 1, "y": 3, "free": 3}


def test_scheduler_mask_budget_is_never_spent_on_a_row_that_cannot_run() -> None:
    """Both slots are x's; y's request waits for one, its tenant served least. Counted
    before the step was chosen, y's first mask took the budget and left the step empty (and
    the engine asleep with work to do); counted over the rows chosen, one of x's goes."""
    scheduler = make_scheduler(max_num_seqs=2, step_mask_budget=0.005)
    for i in range(2):
        scheduler.add_request(constrained(f"x{i}", "x", 0.0))
    step(scheduler)
    for request in list(scheduler.requests.values()):
        assert request.matcher is not None
        request.matcher.token_seconds = 0.004
    scheduler.add_request(constrained("y", "y", 0.004))
    assert shape(step(scheduler)) == {"x0": 1}
    assert shape(step(scheduler)) == {"x1": 1}


def test_scheduler_mask_budget_follows_the_priority_policy() -> None:
    """Under the priority policy the budget goes by priority (lower first), not by the fair
    share's counters: the urgent row goes every step, the other one waits."""
    scheduler = make_scheduler(step_mask_budget=0.005, scheduling_policy="priority")
    urgent, later = constrained("urgent", "u", 0.0), constrained("later", "l", 0.0)
    urgent.tenancy = Tenancy(tenant="u", priority=-5)
    for request in (later, urgent):
        scheduler.add_request(request)
    step(scheduler)
    for request in (later, urgent):
        assert request.matcher is not None
        request.matcher.token_seconds = 0.004
    assert [shape(step(scheduler)) for _ in range(2)] == [{"urgent": 1}, {"urgent": 1}]
