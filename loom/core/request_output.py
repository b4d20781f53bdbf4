"""What a request's consumer receives: new tokens and text as they come, then a final output."""

from __future__ import annotations

import enum

import attrs


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the context length
    STOP_SEQUENCE = "stop_sequence"  # a stop string
    ABORTED = "aborted"  # the consumer went away or asked to abort
    STALLED = "stalled"  # the consumer stopped reading for longer than the stall timeout
    DEADLINE = "deadline"  # the request's deadline passed, queued or mid-decode
    ERROR = "error"  # the engine stopped or crashed
    REFUSED = "refused"  # queued, then its place given to a tenant below its share


NORMAL_FINISHES = frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP_SEQUENCE})


@attrs.frozen(kw_only=True)
class TokenLogprob:
    token_id: int
    logprob: float


@attrs.frozen(kw_only=True)
class Logprobs:
    """The chosen token's log-probability and the top alternatives (most likely first)."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...]


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Speculative decoding: the draft tokens its steps verified, and of those, accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@attrs.frozen(kw_only=True)
class Timings:
    queue_ms: float  # arrival to first scheduled
    ttft_ms: float | None  # arrival to first token; None when no token came
    e2e_ms: float  # arrival to finish


@attrs.frozen(kw_only=True)
class RequestOutput:
    """A delta of new tokens and text; the last one also carries the finish and the totals."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[Logprobs, ...] = ()
    # With the first token of a request that asked for its prompt's logprobs: the prompt's ids
    # and the logprobs of its tokens after the first.
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[Logprobs, ...] = ()
    finish_reason: FinishReason | None = None
    # What stopped it, as vLLM's `stop_reason`: the stop string matched, or the stop token id
    # (one of `stop_token_ids`, not the model's EOS); None for any other end.
    stop_reason: str | int | None = None
    error: str | None = None  # why, for ABORTED, STALLED, DEADLINE, ERROR and REFUSED
    usage: Usage | None = None
    timings: Timings | None = None
    embedding: tuple[float, ...] | None = None  # an embedding's vector, with its final output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
