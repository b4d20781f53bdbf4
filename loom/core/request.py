"""A request's state as the scheduler sees it, and how a sampled token ends it."""

from __future__ import annotations

import enum

import attrs

from loom.core.constraint import Matcher, Thinking
from loom.core.pooling import PoolRows, add_pooled, embedding, pool_rows
from loom.core.request_output import FinishReason, Logprobs
from loom.core.sampling_params import SamplingParams
from loom.core.tenancy import SHARED, Tenancy


class RequestStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished, whatever the reason."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_STOP_SEQUENCE = 5
    FINISHED_ABORTED = 6
    FINISHED_STALLED = 7
    FINISHED_DEADLINE = 8
    FINISHED_ERROR = 9
    FINISHED_REFUSED = 10

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self)


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORTED,
    RequestStatus.FINISHED_STALLED: FinishReason.STALLED,
    RequestStatus.FINISHED_DEADLINE: FinishReason.DEADLINE,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REFUSED: FinishReason.REFUSED,
}


@attrs.frozen(kw_only=True)
class PromptScoring:
    """Which positions of a prompt chunk to score (prompt_logprobs): rows `first_row` on of
    the chunk, row i giving the log-probability of `next_token_ids[i]`, the prompt token that
    follows it. E.g. a prompt [a, b, c, d] in chunks [a, b] and [c, d]: the first chunk scores
    rows 0-1 for b and c, the second row 0 for d (nothing follows d in the prompt)."""

    first_row: int
    next_token_ids: tuple[int, ...]
    num_top: int


@attrs.define(eq=False)
class Request:
    """`num_computed_tokens` catches up with `num_tokens`; when it does, a new token is sampled.

    `request_id` is the engine's own, unique for the engine's life: a client's id is a label the
    server echoes, never a key."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int  # resolved: sampling.max_tokens, or what the context leaves
    eos_token_ids: tuple[int, ...]  # empty when the model has none
    arrival_time: float
    deadline: float | None = None
    output_token_ids: list[int] = attrs.field(factory=list)
    num_computed_tokens: int = 0
    # Tokens sampled in steps scheduled and not yet applied (overlapped scheduling,
    # loom/core/overlap.py): counted in `num_tokens`, their values not yet known.
    num_output_placeholders: int = 0
    num_steps_in_flight: int = 0  # steps scheduled with it and not yet applied
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    paused_since: float | None = None  # its consumer's buffer is full: not scheduled
    output_room: int | None = None  # room left in its consumer's buffer (the engine's count)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_step: int = -1  # the scheduler's count of steps when it was last in one
    error: str | None = None
    cache_salt: str = ""  # in the first block's hash: different salts share no KV block
    block_hashes: list[bytes] = attrs.field(init=False, factory=list)  # of its full blocks
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    tenancy: Tenancy = SHARED
    prompt_logprobs: list[Logprobs] = attrs.field(factory=list)  # of prompt tokens 1.. (asked)
    matcher: Matcher | None = None  # its constraint's state, advanced by each output token
    # A constraint that waits for the thinking to end (`constrain`): held until `</think>`.
    thinking: Thinking | None = None
    held: Matcher | None = None
    # An embedding's (loom/core/pooling.py): its prompt positions pooled so far, and their sum
    # (mean) or the last token's hidden state.
    num_pooled: int = 0
    pooled: list[float] = attrs.field(factory=list, repr=False)
    # Speculative decoding (loom/core/speculative.py): its tokens as the proposer searches
    # them, and the draft tokens it verified and accepted, all time.
    token_bytes: bytearray = attrs.field(init=False, factory=bytearray, repr=False)
    num_drafts: int = 0  # steps with drafts
    draft_misses: int = 0  # drafted steps in a row that kept no draft
    draft_pause: int = 0  # steps it drafts for none, after misses
    draft_lag: int = 0  # the draft model's K/V lack its last token before the last (1) or not
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def tenant(self) -> str:
        return self.tenancy.tenant

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt, output, and the output's placeholders."""
        return self.num_known_tokens + self.num_output_placeholders

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output: the tokens whose values are known."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def scheduled(self, num_new: int, samples: bool) -> None:
        """A step computes `num_new` more of its tokens, counted at once, and (`samples`) a
        token after them, a placeholder until the step is applied (loom/core/overlap.py)."""
        self.num_computed_tokens += num_new
        self.num_output_placeholders += samples
        self.num_steps_in_flight += 1

    def applied(self, num_accepted: int, sampled: bool) -> None:
        """That step's result is in: its accepted drafts computed too, its placeholder gone
        (the token, if any, is taken next)."""
        self.num_computed_tokens += num_accepted
        self.num_output_placeholders -= sampled
        self.num_steps_in_flight -= 1

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens `start:end` of prompt + output, without copying the whole of either."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        output = self.output_token_ids[max(start - num_prompt, 0) : end - num_prompt]
        return self.prompt_token_ids[start:] + tuple(output)

    def prompt_scoring(self, start: int, end: int) -> PromptScoring | None:
        """What a step computing tokens `start:end` scores of the prompt (prompt_logprobs):
        each position's next prompt token, from the first position not yet scored (after a
        preemption the prompt is computed again, and scored once)."""
        top = self.sampling.prompt_logprobs
        first = max(start, len(self.prompt_logprobs))
        last = min(end, self.num_prompt_tokens - 1)  # the last prompt token predicts no prompt
        if top is None or first >= last:
            return None
        return PromptScoring(
            first_row=first - start,
            next_token_ids=self.prompt_token_ids[first + 1 : last + 1],
            num_top=top,
        )

    def pool_rows(self, start: int, end: int) -> PoolRows | None:
        """What a step computing tokens `start:end` pools of an embedding's prompt."""
        pooling = self.sampling.pooling
        return pool_rows(pooling, start, end, self.num_pooled, self.num_prompt_tokens)

    def pool(self, values: tuple[float, ...] | None, rows: PoolRows | None) -> None:
        """A step's pooled values, once its computed tokens are counted."""
        if values is not None and rows is not None:
            self.pooled = add_pooled(self.pooled, values, rows.mean)
            self.num_pooled = min(self.num_computed_tokens, self.num_prompt_tokens)

    @property
    def embedded(self) -> bool:
        """An embedding whose every prompt position is pooled: it is done."""
        return self.sampling.pooling is not None and self.num_pooled == self.num_prompt_tokens

    def embedding(self) -> tuple[float, ...] | None:
        pooling = self.sampling.pooling
        if pooling is None or not self.embedded:
            return None
        return embedding(self.pooled, self.num_prompt_tokens, pooling)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def paused(self) -> bool:
        return self.paused_since is not None

    def constrain(self, matcher: Matcher, thinking: Thinking | None = None) -> None:
        """Bind the constraint's matcher: from the first token, or (`thinking`, unless the
        prompt has closed it) once the thinking ends: deepseek_r1's, or one the prompt opened,
        from the first token on; qwen3's if the answer opens with `<think>` (its first mask
        allows that token too)."""
        last = thinking.last_marker(self.prompt_token_ids) if thinking is not None else None
        if thinking is None or last == thinking.end:
            self.matcher = matcher
            return
        self.thinking = thinking
        if thinking.model_opens and last is None:
            self.matcher, matcher.opening = matcher, thinking.start
        else:  # the template opens the thinking, or has opened it
            self.held = matcher

    def take(self, token_id: int) -> bool:
        """A sampled token: the output's next, and its constraint's (a preemption keeps both,
        so the matcher stays in step with the output it has seen). True when it ends the
        thinking: the constraint binds from the next token."""
        self.output_token_ids.append(token_id)
        if self.held is not None and self.thinking is not None:
            if token_id != self.thinking.end:
                return False
            self.matcher, self.held = self.held, None
            return True
        if self.matcher is not None:
            opening, self.matcher.opening = self.matcher.opening, None
            if token_id == opening:  # the thinking opens: the constraint waits for its end
                self.matcher, self.held = None, self.matcher
                return False
            self.matcher.consume(token_id)
        return False

    def stop_error(self) -> str | None:
        """Why the request's constraint failed, if it did."""
        return (self.matcher.error() or None) if self.matcher is not None else None

    def stop_status(self) -> RequestStatus | None:
        """How the last sampled token ends the request, if it does (stop strings aside)."""
        token = self.output_token_ids[-1]
        num_output = len(self.output_token_ids)
        if self.matcher is not None:
            # The grammar decides: complete (EOS was its only next token, or it took EOS
            # where it may end), or failed; an EOS inside the grammar (a literal) is text.
            if self.matcher.is_stopped():
                error = self.matcher.error()
                return RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_STOPPED
            return RequestStatus.FINISHED_LENGTH if num_output >= self.max_tokens else None
        if num_output >= self.sampling.min_tokens and (
            token in self.sampling.stop_token_ids
            or (token in self.eos_token_ids and not self.sampling.ignore_eos)
        ):
            return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
