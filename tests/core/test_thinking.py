"""A constraint that waits for a reasoning model's thinking to end (`Request.constrain`): held
until `</think>` (deepseek_r1), or bound with `<think>` allowed first (qwen3: taking it holds
the constraint), or bound at once when the prompt closed the thinking; and in the scheduler,
the tokens a step drafted past `</think>` are dropped (no mask chose them)."""

from __future__ import annotations

import attrs

from loom.core.constraint import Thinking
from loom.core.request import Request
from loom.core.speculative import SpeculativeConfig
from tests.core.test_scheduler import make_scheduler
from tests.support.factory import make_request, sampled, speculated

START, END = 90, 91
QWEN3 = Thinking(end=END, start=START, model_opens=True)
DEEPSEEK = Thinking(end=END, start=START, model_opens=False)


@attrs.define
class Recording:
    """A stand-in for the grammar (loom/model/grammar.py): the tokens it was given."""

    consumed: list[int] = attrs.field(factory=list)
    token_seconds: float = 0.0
    step_seconds: float = 0.0
    opening: int | None = None

    def consume(self, token_id: int) -> None:
        self.consumed.append(token_id)

    def is_stopped(self) -> bool:
        return False

    def error(self) -> str:
        return ""


def taken(request: Request, tokens: list[int]) -> list[bool]:
    return [request.take(t) for t in tokens]


def test_deepseek_r1_holds_the_constraint_until_the_thinking_ends() -> None:
    request, grammar = make_request("r"), Recording()
    request.constrain(grammar, DEEPSEEK)
    assert (request.matcher, request.held) == (None, grammar)
    assert taken(request, [START, 5, 6, END, 7, 8]) == [False, False, False, True, False, False]
    assert request.matcher is grammar
    assert grammar.consumed == [7, 8]


def test_qwen3_allows_think_first_and_binds_from_the_first_token_without_it() -> None:
    thinks, grammar = make_request("t"), Recording()
    thinks.constrain(grammar, QWEN3)
    assert (thinks.matcher, grammar.opening) == (grammar, START)
    assert taken(thinks, [START, 5, START, END, 7]) == [False, False, False, True, False]
    assert (grammar.consumed, grammar.opening) == ([7], None)
    answers, other = make_request("a"), Recording()
    answers.constrain(other, QWEN3)
    taken(answers, [7, START])  # <think> after the first token is the grammar's to judge
    assert (other.consumed, other.opening) == ([7, START], None)


def test_a_prompt_that_closed_the_thinking_binds_at_once_one_that_opened_it_holds() -> None:
    """The prompt's last marker decides: `</think>` (thinking off) binds the constraint at
    once; `<think>` (a template that opens the thinking: QwQ's, Qwen3's Thinking-2507) holds
    it, even for qwen3's parser."""
    closed, opened = (1, START, 2, END, 3), (END, 1, START, 2)
    for thinking in (QWEN3, DEEPSEEK):
        for prompt, bound in ((closed, True), (opened, False)):
            request, grammar = attrs.evolve(make_request("p"), prompt_token_ids=prompt), Recording()
            request.constrain(grammar, thinking)
            assert (request.matcher is grammar, request.held is grammar) == (bound, not bound)
    assert QWEN3.last_marker((1, 2)) is None


def test_tokens_drafted_past_the_end_of_thinking_are_dropped() -> None:
    scheduler = make_scheduler()
    request, grammar = make_request("d"), Recording()
    request.constrain(grammar, DEEPSEEK)
    scheduler.add_request(request)
    taken = scheduler.outputs.take(request, [(5, None), (END, None), (6, None)], 0.0)
    assert taken.delta is not None
    assert (taken.delta.token_ids, taken.status) == ((5, END), None)
    assert request.output_token_ids == [5, END]
    assert grammar.consumed == []


def test_a_step_cut_at_the_end_of_thinking_computes_its_last_token_again() -> None:
    """`</think>` accepted as a draft with more drafts after it: those are dropped, and the
    next step computes `</think>` again (its logits are the grammar's first row), never a
    step with no token to compute (that sampled another row's state, or crashed)."""
    ngram = SpeculativeConfig(
        speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
        prompt_lookup_max=2,
    )  # fmt: skip
    scheduler = make_scheduler(speculative=ngram)
    request, grammar = make_request("s"), Recording()
    request = attrs.evolve(request, prompt_token_ids=(5, 1, 2, END, 7, START, 1))
    request.constrain(grammar, DEEPSEEK)
    scheduler.add_request(request)
    first = scheduler.schedule(now=0.0)
    assert first is not None
    scheduler.update(first, sampled(first, token_id=2), now=0.0)
    drafted = scheduler.schedule(now=0.0)
    assert drafted is not None
    assert drafted.sequences[0].draft_token_ids == (END, 7, START)
    scheduler.update(drafted, speculated(drafted, num_accepted=3, bonus=9), now=0.0)
    assert request.output_token_ids == [2, END]
    following = scheduler.schedule(now=0.0)
    assert following is not None
    (seq,) = following.sequences
    assert (seq.token_ids[0], seq.num_computed_tokens) == (END, 8)  # prompt 7, then 2
    assert seq.sampling is not None  # (with drafts again: the grammar's masks verify them)
    assert seq.token_ids[1:] == seq.draft_token_ids
    assert request.matcher is grammar
