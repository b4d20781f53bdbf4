"""Speculative decoding's core: the n-gram proposer, the verdicts, and the scheduler with drafts
(plain Python, runner outputs made up: tests/support/factory.py)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from loom.core.block_manager import BlockManager
from loom.core.config import SchedulerConfig
from loom.core.prefix_cache import block_hashes
from loom.core.request import Request, RequestStatus
from loom.core.request_output import Logprobs, TokenLogprob
from loom.core.sampling_params import SamplingParams
from loom.core.scheduler import Scheduler
from loom.core.speculative import NgramProposer, SpeculativeConfig, accepted, emitted
from loom.core.step import SamplingInput, ScheduledSequence, SchedulerOutput
from tests.support.factory import make_request, sampled, speculated

NGRAM = SpeculativeConfig(
    speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2
)


def with_tokens(tokens: list[int], **kwargs: Any) -> Request:
    return attrs.evolve(make_request("r", **kwargs), prompt_token_ids=tuple(tokens))


def test_ngram_proposes_the_tokens_after_the_longest_earliest_match() -> None:
    assert NgramProposer(1, 2).propose(with_tokens([1, 2, 3, 4, 2, 3]), 3) == (4, 2, 3)
    # [2, 3] (n = 2) wins over [3] (n = 1), which occurs earlier
    tokens = [5, 3, 9, 9, 1, 2, 3, 7, 2, 3]
    assert NgramProposer(1, 2).propose(with_tokens(tokens), 3) == (7, 2, 3)
    # the earliest of two occurrences
    assert NgramProposer(2, 2).propose(with_tokens([1, 2, 8, 1, 2, 9, 1, 2]), 2) == (8, 1)


def test_ngram_proposes_nothing_below_min_n_or_with_no_match_and_at_most_k() -> None:
    assert NgramProposer(2, 3).propose(with_tokens([1, 2, 3, 4, 5, 3]), 3) == ()
    assert NgramProposer(1, 3).propose(with_tokens([1, 2, 3, 4]), 3) == ()
    assert NgramProposer(1, 2).propose(with_tokens([1, 2, 3, 4, 2, 3]), 1) == (4,)
    assert NgramProposer(1, 2).propose(with_tokens([1, 2, 3, 4, 2, 3]), 0) == ()
    # what follows the match may run into the suffix itself: fewer than k
    assert NgramProposer(1, 1).propose(with_tokens([7, 7]), 3) == (7,)


def test_ngram_follows_the_output_as_it_grows() -> None:
    request = with_tokens([1, 2, 3, 4])
    proposer = NgramProposer(1, 2)
    assert proposer.propose(request, 3) == ()
    request.take(2)
    assert proposer.propose(request, 3) == (3, 4, 2)
    request.take(9)
    assert proposer.propose(request, 3) == ()


def test_ngram_ignores_a_match_that_splits_tokens() -> None:
    # bytes (little-endian): a = 05 00 01 00, b = 02 00 07 00, t = 01 00 02 00: t's bytes occur
    # at byte 2, across a and b, and nowhere on a token of its own before the end
    a, b, t = 0x00010005, 0x00070002, 0x00020001
    assert NgramProposer(1, 1).propose(with_tokens([a, b, 9, t]), 2) == ()
    assert NgramProposer(1, 1).propose(with_tokens([a, b, t, 9, t]), 2) == (9, t)


def test_accepted_is_the_longest_common_start() -> None:
    assert accepted([4, 2, 9], (4, 2, 3)) == 2
    assert accepted([4, 2, 3, 1], (4, 2, 3)) == 3
    assert accepted([5], (4,)) == 0
    assert accepted([5], ()) == 0


def test_emitted_keeps_the_accepted_drafts_and_the_token_after_them() -> None:
    row = SamplingInput(params=SamplingParams(), num_output_tokens=0, eos_token_ids=())
    plain = ScheduledSequence(
        request_id="a", token_ids=(1,), num_computed_tokens=3, block_table=(1,), sampling=row
    )
    drafted = attrs.evolve(plain, request_id="b", token_ids=(1, 4, 5, 6), draft_token_ids=(4, 5, 6))
    logprobs = [Logprobs(chosen=TokenLogprob(token_id=t, logprob=-t), top=()) for t in range(5)]
    # rows: a's one, then b's four: b samples 4, 5 (accepting two drafts), then 0 (not 6)
    result = emitted([plain, drafted], [9, 4, 5, 0, 3], [*logprobs[:5]])
    assert result.request_ids == ("a", "b", "b", "b")
    assert result.token_ids == (9, 4, 5, 0)
    assert result.logprobs == tuple(logprobs[:4])


def test_sampling_input_ahead_moves_the_position_and_the_penalised_tokens() -> None:
    plain = SamplingInput(params=SamplingParams(), num_output_tokens=2, eos_token_ids=())
    assert plain.ahead((4, 5)).num_output_tokens == 4
    assert plain.ahead((4, 5)).output_token_ids == ()
    params = SamplingParams(presence_penalty=1.0)
    penalised = attrs.evolve(plain, params=params, output_token_ids=(8, 9))
    assert penalised.ahead((4,)).output_token_ids == (8, 9, 4)
    assert penalised.ahead(()) is penalised


def make_scheduler(num_blocks: int = 64, *, caching: bool = False, **config: Any) -> Scheduler:
    blocks = BlockManager(num_blocks=num_blocks, block_size=4, enable_caching=caching)
    return Scheduler(SchedulerConfig(speculative=NGRAM, **config), blocks)


def first_step(scheduler: Scheduler, request: Request, token: int = 3) -> None:
    """The request's prompt prefilled and `token` sampled."""
    scheduler.add_request(request)
    output = scheduler.schedule(now=0.0)
    assert output is not None
    assert output.sequences[0].draft_token_ids == ()
    scheduler.update(output, sampled(output, token), now=0.0)


def drafted(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule(now=0.0)
    assert output is not None
    return output


def test_scheduler_budgets_k_plus_one_and_caps_drafts_by_budget_and_max_tokens() -> None:
    scheduler = make_scheduler()
    first_step(scheduler, with_tokens([1, 2, 3, 1, 2]))  # then 3: [.., 2, 3] occurred at 1
    (seq,) = drafted(scheduler).sequences
    assert seq.draft_token_ids == (1, 2, 3)
    assert seq.token_ids == (3, 1, 2, 3)
    assert len(seq.block_table) * 4 >= seq.num_computed_tokens + 4
    tight = make_scheduler(max_num_batched_tokens=2)
    first_step(tight, with_tokens([1, 2, 3, 1]))  # in two chunks: the first
    second = drafted(tight)  # two tokens to compute: no drafts
    assert second.sequences[0].draft_token_ids == ()
    tight.update(second, sampled(second, 2), now=0.0)
    assert drafted(tight).sequences[0].draft_token_ids == (3,)
    short = make_scheduler()
    first_step(short, with_tokens([1, 2, 3, 1, 2], max_tokens=3))
    assert drafted(short).sequences[0].draft_token_ids == (1,)  # 1 draft + 1 token = the last 2


def test_scheduler_drafts_neither_for_a_switched_off_request_nor_when_blocks_are_short() -> None:
    off = make_scheduler()
    request = with_tokens([1, 2, 3, 1, 2])
    request.sampling = SamplingParams(max_tokens=100, speculative=False)
    first_step(off, request)
    assert drafted(off).sequences[0].draft_token_ids == ()
    short = make_scheduler(num_blocks=3)  # 2 blocks of 4: the 6 tokens, not 6 + 3 drafts
    first_step(short, with_tokens([1, 2, 3, 1, 2]))
    (seq,) = drafted(short).sequences
    assert seq.token_ids == (3,)
    assert short.num_preemptions == 0


def test_scheduler_rolls_back_rejected_drafts_and_releases_their_blocks() -> None:
    scheduler = make_scheduler()
    request = with_tokens([1, 2, 3, 1, 2])
    first_step(scheduler, request)
    free = scheduler.block_manager.num_free_blocks
    output = drafted(scheduler)  # 6 tokens + 3 drafts: a third block
    assert scheduler.block_manager.num_free_blocks == free - 1
    ((_, delta),) = scheduler.update(output, speculated(output, 0, bonus=9), now=0.0)
    assert delta.token_ids == (9,)
    assert request.output_token_ids == [3, 9]
    assert request.num_computed_tokens == request.num_tokens - 1 == 6
    assert scheduler.block_manager.num_free_blocks == free  # the third released at once
    assert (scheduler.spec.num_draft_tokens, scheduler.spec.num_accepted_tokens) == (3, 0)


def test_scheduler_keeps_accepted_drafts_in_one_delta() -> None:
    scheduler = make_scheduler()
    request = with_tokens([1, 2, 3, 1, 2])
    first_step(scheduler, request)
    output = drafted(scheduler)
    ((_, delta),) = scheduler.update(output, speculated(output, 3, bonus=8), now=0.0)
    assert delta.token_ids == (1, 2, 3, 8)
    assert request.output_token_ids == [3, 1, 2, 3, 8]
    assert request.num_computed_tokens == request.num_tokens - 1 == 9
    assert len(scheduler.block_manager.block_table("r")) == 3
    assert scheduler.spec.accepted_per_pos == [1, 1, 1]
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (3, 3)


@pytest.mark.parametrize("caching", [False, True])
def test_scheduler_stops_at_a_stop_inside_the_accepted_drafts(caching: bool) -> None:
    scheduler = make_scheduler(caching=caching)
    request = with_tokens([1, 2, 3, 1, 2], eos_token_ids=(1,))
    first_step(scheduler, request)
    output = drafted(scheduler)  # drafts 1, 2, 3: K/V for 9 tokens, the second block's full
    ((_, final),) = scheduler.update(output, speculated(output, 3, bonus=8), now=0.0)
    assert final.token_ids == (1,)
    assert final.finish_reason == "stop"
    assert request.output_token_ids == [3, 1]  # two drafts and the bonus dropped: 7 tokens
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_total_blocks
    # Only blocks of the kept tokens were hashed, each from its own tokens (a hash made from
    # K/V computed past the output would be kept, wrong, for as long as the request lives).
    fresh = attrs.evolve(with_tokens([1, 2, 3, 1, 2, 3, 1, 2]))
    assert request.block_hashes == block_hashes(fresh, 4, 8)[: len(request.block_hashes)]
    assert len(request.block_hashes) == (1 if caching else 0)


def test_scheduler_drafts_from_what_every_request_leaves_never_starving_one() -> None:
    """Three decoding requests, 4 tokens a step: each gets its token first; the one left over
    is the first's draft (greedy drafting in order would give the first all four)."""
    scheduler = make_scheduler(max_num_batched_tokens=4)
    requests = [attrs.evolve(with_tokens([1, 2, 3, 1]), request_id=name) for name in "abc"]
    for request in requests:
        scheduler.add_request(request)
    while not all(r.output_token_ids for r in requests):  # prefilled, each sampling 2 (and
        output = drafted(scheduler)  # then [.., 1, 2] has occurred: drafts to propose)
        scheduler.update(output, speculated(output, 0, bonus=2), now=0.0)
    output = drafted(scheduler)
    assert sorted(len(s.token_ids) for s in output.sequences) == [1, 1, 2]


def test_scheduler_takes_no_block_for_a_draft_that_a_request_needs() -> None:
    """One block free: b's next token needs it; a's drafts would too. b gets it, a drafts
    nothing, and no one is preempted (drafting first, in order, preempted b)."""
    scheduler = make_scheduler(num_blocks=6)  # 5 of 4 tokens
    scheduler.add_request(attrs.evolve(with_tokens([1, 2, 3, 1, 2]), request_id="a"))
    scheduler.add_request(attrs.evolve(with_tokens(list(range(1, 9))), request_id="b"))
    output = drafted(scheduler)  # 5 + 8 prompt tokens: 2 + 2 blocks
    scheduler.update(output, sampled(output, 3), now=0.0)
    assert scheduler.block_manager.num_free_blocks == 1
    output = drafted(scheduler)
    assert {s.request_id for s in output.sequences} == {"a", "b"}
    assert output.sequences[0].draft_token_ids == ()  # a's: no block left for them
    assert scheduler.num_preemptions == 0


def test_scheduler_backs_off_from_a_request_whose_drafts_miss() -> None:
    """A drafted step that keeps none: the next step drafts nothing, the one after drafts
    again; two misses in a row: three steps without drafts; a kept draft ends the back-off."""
    scheduler = make_scheduler()
    first_step(scheduler, with_tokens([1, 2, 3, 1, 2]))
    seen = []
    for accept in (0, None, 0, None, None, None, 1, 0):
        output = drafted(scheduler)
        seen.append(len(output.sequences[0].draft_token_ids))
        result = speculated(output, accept or 0, bonus=3)  # 3: the drafts go on matching
        scheduler.update(output, result, now=0.0)
    assert [n > 0 for n in seen] == [True, False, True, False, False, False, True, True]
