"""From the scheduler's updates to `RequestOutput`s: detokenise, match stop strings, time, count.

For each token a request receives it makes the delta (token, UTF-8-safe text, logprobs; the
first also the prompt's logprobs, when asked); a delta whose text reached a stop string says
so (`stop_sequence`): the one stop that text decides, the scheduler deciding the others as it
calls this (Scheduler.update). For each finished
request it makes the final output (finish reason, usage, timings). Without a tokenizer there is
no text and no stop string.
"""

from __future__ import annotations

from typing import Any

import attrs

from loom.core.detokenizer import IncrementalDetokenizer
from loom.core.request import Request, RequestStatus
from loom.core.request_output import FinishReason, Logprobs, RequestOutput, Timings, Usage


@attrs.frozen
class Taken:
    """A request's tokens of a step, taken up to the first that ends it."""

    delta: RequestOutput | None  # their one delta (None: no token)
    status: RequestStatus | None  # how the request ends (None: it goes on)
    num_tokens: int
    grammar_seconds: float  # what its matcher's consumes of them took


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, request: Request) -> None:
        if self.tokenizer is not None:
            self.detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.sampling.stop
            )

    def new_token(self, request: Request, logprobs: Logprobs | None, last: bool) -> RequestOutput:
        """The delta for the request's newest token (`last`: a token stop ends the request
        there); its finish reason is `stop_sequence` if a stop string ends it there."""
        token = request.output_token_ids[-1]
        text, stop = "", None
        detokenizer = self.detokenizers.get(request.request_id)
        if detokenizer is not None:
            text, stop = detokenizer.add(token)
            if last and stop is None:
                text += detokenizer.flush()  # the last token: nothing more will complete it
        scored = request.sampling.prompt_logprobs is not None
        first = scored and len(request.output_token_ids) == 1
        return RequestOutput(
            request_id=request.request_id,
            token_ids=(token,),
            text=text,
            logprobs=() if logprobs is None else (logprobs,),
            prompt_token_ids=request.prompt_token_ids if first else (),
            prompt_logprobs=tuple(request.prompt_logprobs) if first else (),
            finish_reason=None if stop is None else FinishReason.STOP_SEQUENCE,
            stop_reason=stop,
        )

    def take(
        self, request: Request, tokens: list[tuple[int, Logprobs | None]], now: float
    ) -> Taken:
        """A request's new tokens taken, each detokenised, up to the first that ends it (a
        token stop or a stop string), or that ends its thinking (the tokens after it were
        drafted unconstrained)."""
        deltas, status, seconds = [], None, 0.0
        for token_id, logprobs in tokens:
            bound = request.take(token_id)
            if request.matcher is not None:
                seconds += request.matcher.step_seconds
            if request.first_token_time is None:
                request.first_token_time = now
            status = request.stop_status()
            deltas.append(self.new_token(request, logprobs, last=status is not None))
            if deltas[-1].finish_reason is FinishReason.STOP_SEQUENCE:
                status = RequestStatus.FINISHED_STOP_SEQUENCE
            if status is not None or bound:
                break
        return Taken(merged(deltas) if deltas else None, status, len(deltas), seconds)

    def final(
        self, request: Request, now: float, delta: RequestOutput | None = None
    ) -> RequestOutput:
        """The last output of a request the scheduler has finished (with its last delta, if the
        request ended on a token)."""
        self.detokenizers.pop(request.request_id, None)
        reason = request.status.finish_reason
        if reason is None:
            raise ValueError(f"request {request.request_id} is not finished")
        delta = delta or RequestOutput(request_id=request.request_id)
        return attrs.evolve(
            delta,
            finish_reason=reason,
            stop_reason=delta.stop_reason if delta.stop_reason is not None else stop_token(request),
            error=request.error,
            usage=Usage(
                prompt_tokens=request.num_prompt_tokens,
                completion_tokens=len(request.output_token_ids),
                cached_tokens=request.num_cached_tokens,
                draft_tokens=request.num_draft_tokens,
                accepted_draft_tokens=request.num_accepted_tokens,
            ),
            timings=timings(request, now),
            embedding=request.embedding(),
        )


def merged(deltas: list[RequestOutput]) -> RequestOutput:
    """One delta for a request's tokens of one step (with drafts accepted, several): their
    tokens, text and logprobs in order, the first's prompt logprobs, the last's stop."""
    if len(deltas) == 1:
        return deltas[0]
    return attrs.evolve(
        deltas[-1],
        token_ids=tuple(t for d in deltas for t in d.token_ids),
        text="".join(d.text for d in deltas),
        logprobs=tuple(lp for d in deltas for lp in d.logprobs),
        prompt_token_ids=deltas[0].prompt_token_ids,
        prompt_logprobs=deltas[0].prompt_logprobs,
    )


def stop_token(request: Request) -> int | None:
    """The stop token id that ended the request, if one of `stop_token_ids` did and it is not
    the model's EOS (vLLM's `stop_reason`: the EOS is checked first)."""
    last = request.output_token_ids[-1:]
    if request.status.finish_reason is not FinishReason.STOP or not last:
        return None
    token = last[0]
    stop = token in request.sampling.stop_token_ids and token not in request.eos_token_ids
    return token if stop else None


def timings(request: Request, now: float) -> Timings:
    def since_arrival(t: float | None) -> float | None:
        return None if t is None else (t - request.arrival_time) * 1000

    return Timings(
        queue_ms=since_arrival(request.first_scheduled_time or now) or 0.0,
        ttft_ms=since_arrival(request.first_token_time),
        e2e_ms=(now - request.arrival_time) * 1000,
    )
