"""The scheduler one step ahead (overlapped scheduling): step N + 1 scheduled before step N's
result is applied. Plain Python, driven step by step with made-up sampled tokens."""

from __future__ import annotations

import pytest

from loom.core.overlap import step_runs_ahead
from loom.core.request import RequestStatus
from loom.core.sampling_params import SamplingParams
from loom.core.scheduler import Scheduler
from loom.core.speculative import SpeculativeConfig
from loom.core.step import PLACEHOLDER, ModelRunnerOutput, SchedulerOutput
from loom.core.tenancy import Tenancy
from tests.core.test_scheduler import make_scheduler, shape
from tests.core.test_thinking import Recording
from tests.support.factory import make_request, sampled


def schedule(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule(now=0.0)
    assert output is not None
    return output


def tokens(output: SchedulerOutput, **by_request: int) -> ModelRunnerOutput:
    """The runner's result for `output`: each sampling sequence's token from `by_request`."""
    ids = tuple(s.request_id for s in output.sequences if s.sampling is not None)
    return ModelRunnerOutput(
        request_ids=ids, token_ids=tuple(by_request[i] for i in ids), logprobs=(None,) * len(ids)
    )


def test_scheduler_ahead_decodes_a_placeholder_for_the_token_in_flight() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    first = schedule(scheduler)  # the prompt: samples a placeholder
    request = scheduler.requests["a"]
    assert (request.num_computed_tokens, request.num_tokens) == (3, 4)
    second = schedule(scheduler)  # before `first` is applied
    (seq,) = second.sequences
    assert seq.pending_token
    assert seq.token_ids == (PLACEHOLDER,)
    assert seq.num_computed_tokens == 3
    assert seq.sampling is not None
    assert seq.sampling.num_output_tokens == 1  # it samples the second output token
    assert (request.num_computed_tokens, request.num_tokens) == (4, 5)
    scheduler.update(first, tokens(first, a=11), now=0.0)
    assert request.output_token_ids == [11]
    assert request.num_output_placeholders == 1
    third = schedule(scheduler)  # ahead of `second`: 11 is known, the next is not
    assert third.sequences[0].pending_token
    scheduler.update(second, tokens(second, a=12), now=0.0)
    scheduler.update(third, tokens(third, a=13), now=0.0)
    assert request.output_token_ids == [11, 12, 13]
    assert (request.num_computed_tokens, request.num_tokens) == (5, 6)
    fourth = schedule(scheduler)  # all applied: the real token again
    assert not fourth.sequences[0].pending_token
    assert fourth.sequences[0].token_ids == (13,)


def test_scheduler_ahead_continues_a_prompt_in_chunks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", 10))
    first, second = schedule(scheduler), schedule(scheduler)
    assert [s.token_ids for s in (first.sequences + second.sequences)] == [
        (1, 2, 3, 4),
        (5, 6, 7, 8),
    ]
    assert second.sequences[0].num_computed_tokens == 4
    assert not second.sequences[0].pending_token
    scheduler.update(first, sampled(first), now=0.0)
    third = schedule(scheduler)
    assert third.sequences[0].token_ids == (9, 10)
    assert third.sequences[0].sampling is not None


def test_scheduler_ahead_stops_at_max_tokens() -> None:
    """A request whose step in flight samples its last token is not scheduled ahead of it:
    no step is spent on a token past max_tokens."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=2))
    first, second = schedule(scheduler), schedule(scheduler)  # tokens 1 and 2 in flight
    assert scheduler.schedule(now=0.0) is None
    scheduler.update(first, sampled(first), now=0.0)
    assert scheduler.schedule(now=0.0) is None  # `second` ends it
    scheduler.update(second, sampled(second), now=0.0)
    assert "a" not in scheduler.requests
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks - 1


def test_scheduler_ahead_drops_the_token_of_a_request_that_ended_in_the_step_before() -> None:
    """Request a stops (EOS) in step N while step N + 1 computes its next token: that token is
    never emitted, and a's blocks are freed when N is applied."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, eos_token_ids=(2,)))
    scheduler.add_request(make_request("b", 3))
    first, second = schedule(scheduler), schedule(scheduler)
    assert shape(second) == {"a": 1, "b": 1}
    advanced = scheduler.update(first, tokens(first, a=2, b=5), now=0.0)
    assert [(r.request_id, o.finished) for r, o in advanced] == [("a", True), ("b", False)]
    assert scheduler.block_manager.block_table("a") == ()
    advanced = scheduler.update(second, tokens(second, a=9, b=6), now=0.0)
    assert [(r.request_id, o.token_ids) for r, o in advanced] == [("b", (6,))]


def test_scheduler_ahead_never_preempts_a_request_in_flight() -> None:
    """Blocks run out while both requests are in flight: the step ahead leaves out what needs
    them, preempting nothing; once the step is applied, the next preempts as usual."""
    scheduler = make_scheduler(num_blocks=3, block_size=4)  # 2 usable blocks
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 4))
    first = schedule(scheduler)  # both prompts fill a block each; each samples a placeholder
    assert scheduler.schedule(now=0.0) is None  # each needs a second block: none is free
    assert scheduler.num_preemptions == 0
    scheduler.update(first, sampled(first), now=0.0)
    second = schedule(scheduler)
    assert scheduler.num_preemptions == 1
    assert shape(second) == {"a": 1}
    assert scheduler.requests["b"].status is RequestStatus.PREEMPTED


def test_scheduler_ahead_skips_a_request_whose_step_fills_its_buffer() -> None:
    """Room for one output more: the step in flight fills the buffer (and pauses it)."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 3))
    schedule(scheduler)
    scheduler.requests["a"].output_room = 1
    assert shape(schedule(scheduler)) == {"b": 1}


@pytest.mark.parametrize(
    ("sampling", "config"),
    [
        (SamplingParams(frequency_penalty=0.5), {"async_scheduling": True}),  # (it counts)
        (SamplingParams(), {"async_scheduling": False}),
        (
            SamplingParams(),
            {
                "async_scheduling": True,
                "speculative": SpeculativeConfig(speculative_method="ngram"),
            },
        ),
    ],
    ids=["penalties", "off", "speculative"],
)
def test_overlap_runs_ahead_of_no_step_that_needs_its_tokens(
    sampling: SamplingParams, config: dict[str, object]
) -> None:
    scheduler = make_scheduler(**config)
    scheduler.add_request(make_request("a", 3, sampling=sampling))
    first = schedule(scheduler)
    assert not step_runs_ahead(scheduler.config, scheduler.requests, first)
    plain = make_scheduler(async_scheduling=True)
    plain.add_request(make_request("a", 3))
    assert step_runs_ahead(plain.config, plain.requests, schedule(plain))


def drive(
    scheduler: Scheduler, num_steps: int, flight: SchedulerOutput | None = None
) -> SchedulerOutput | None:
    """`num_steps` turns of the engine's loop: the next step scheduled (ahead where allowed),
    then the one in flight applied. The step left in flight."""
    for _ in range(num_steps):
        output = None
        if flight is None or step_runs_ahead(scheduler.config, scheduler.requests, flight):
            output = scheduler.schedule(now=0.0)
        if flight is not None:
            scheduler.update(flight, sampled(flight), now=0.0)
        flight = output
    return flight


def test_scheduler_ahead_defers_the_policy_s_victim_in_flight() -> None:
    """The high-priority request needs a block that the low-priority one (in flight) holds:
    the step ahead leaves both out, preempting nothing, and the next preempts the
    low-priority one, as the serial loop does (never the request the policy protects)."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, scheduling_policy="priority")
    scheduler.add_request(make_request("hi", 4))
    low = make_request("low", 8)
    low.tenancy = Tenancy(priority=5)
    scheduler.add_request(low)
    first = schedule(scheduler)  # the prompts take the 3 blocks
    assert scheduler.schedule(now=0.0) is None
    assert scheduler.num_preemptions == 0
    scheduler.update(first, sampled(first), now=0.0)
    assert shape(schedule(scheduler)) == {"hi": 1}
    assert low.status is RequestStatus.PREEMPTED
    assert scheduler.requests["hi"].num_preemptions == 0


def test_scheduler_ahead_keeps_fair_shares() -> None:
    """Tenant a's two long requests hold both slots when tenant b's arrives: one of a's is
    preempted and b's runs within 30 steps, with steps ahead as without them (the serial loop
    takes 18 here, the loop ahead 10)."""
    scheduler = make_scheduler(
        max_num_seqs=2, max_num_batched_tokens=64, num_blocks=256, async_scheduling=True
    )
    for name in ("a0", "a1"):
        request = make_request(name, 3, max_tokens=400)
        request.tenancy = Tenancy(tenant="a")
        scheduler.add_request(request)
    flight = drive(scheduler, 20)
    late = make_request("b0", 3, max_tokens=5)
    late.tenancy = Tenancy(tenant="b")
    scheduler.add_request(late)
    drive(scheduler, 30, flight)
    assert scheduler.num_preemptions == 1
    assert late.finished or late.status is RequestStatus.RUNNING


def test_scheduler_caches_the_blocks_a_draft_model_s_steps_fill() -> None:
    """The draft model's drafts are the runner's (not in the scheduled tokens): the blocks a
    step fills are cached as the step's accepted tokens fill them."""
    draft = SpeculativeConfig(speculative_method="draft", num_speculative_tokens=3)
    scheduler = make_scheduler(caching=True, speculative=draft)
    request = make_request("a", 8, max_tokens=40)
    scheduler.add_request(request)
    token = 100
    while scheduler.has_unfinished():
        output = schedule(scheduler)
        (seq,) = output.sequences
        drafted = tuple(range(token, token + seq.num_draft_slots))
        kept = (*drafted[:1], token + 50)  # one draft accepted
        token += 1
        result = ModelRunnerOutput(
            request_ids=("a",) * len(kept),
            token_ids=kept,
            logprobs=(None,) * len(kept),
            drafts={"a": drafted} if drafted else {},
        )
        scheduler.update(output, result, now=0.0)
    assert scheduler.block_manager.num_cached_blocks == (8 + 40 - 1) // 4  # (the last: no K/V)


def test_overlap_runs_ahead_of_no_step_with_constrained_rows_even_once_they_ended() -> None:
    """Its masks may still be filling, whether or not its requests still run: no second fill
    may start beside it (a fill waits on its other half in the same two threads)."""
    scheduler = make_scheduler(async_scheduling=True)
    request = make_request("g", 3)
    request.constrain(Recording())
    scheduler.add_request(request)
    first = schedule(scheduler)
    assert first.sequences[0].sampling is not None
    assert first.sequences[0].sampling.constrained
    scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert not step_runs_ahead(scheduler.config, scheduler.requests, first)
