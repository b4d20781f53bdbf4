"""From sampled tokens to RequestOutputs: detokenise, check the stops, count, time.

Plain Python in the scheduling task: no trio, no torch. For each token a request receives it
makes the delta (token, UTF-8-safe text, logprobs) and says whether the request ends there (EOS
or a stop token id, a stop string, max_tokens); for each finished request it makes the final
output (finish reason, usage, timings).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs

from loom.detokenizer import IncrementalDetokenizer
from loom.request import Request, RequestStatus
from loom.request_output import FinishReason, Logprobs, RequestOutput, Timings, Usage


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer  # None: token ids only, no text and no stop strings
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.finished = Counter[FinishReason]()
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    def add_request(self, request: Request) -> None:
        self.num_prompt_tokens += request.num_prompt_tokens
        if self.tokenizer is not None:
            self.detokenizers[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, request.sampling.stop
            )

    def new_token(
        self, request: Request, logprobs: Logprobs | None, now: float
    ) -> tuple[RequestOutput, RequestStatus | None]:
        """The delta for the request's newest token, and how the request ends, if it does."""
        if request.first_token_time is None:
            request.first_token_time = now
        self.num_generated_tokens += 1
        token = request.output_token_ids[-1]
        status = request.stop_status()
        text = ""
        detokenizer = self.detokenizers.get(request.request_id)
        if detokenizer is not None:
            text, hit_stop = detokenizer.add(token)
            if hit_stop:
                status = RequestStatus.FINISHED_STOP_SEQUENCE
            elif status is not None:
                text += detokenizer.flush()
        delta = RequestOutput(
            request_id=request.request_id,
            token_ids=(token,),
            text=text,
            logprobs=() if logprobs is None else (logprobs,),
        )
        return delta, status

    def final(
        self, request: Request, now: float, delta: RequestOutput | None = None
    ) -> RequestOutput:
        """The last output of a request the scheduler has just finished."""
        self.detokenizers.pop(request.request_id, None)
        reason = request.status.finish_reason
        if reason is None:
            raise ValueError(f"request {request.request_id} is not finished")
        self.finished[reason] += 1
        return attrs.evolve(
            delta or RequestOutput(request_id=request.request_id),
            finish_reason=reason,
            error=request.error,
            usage=Usage(
                prompt_tokens=request.num_prompt_tokens,
                completion_tokens=len(request.output_token_ids),
            ),
            timings=timings(request, now),
        )


def timings(request: Request, now: float) -> Timings:
    def since_arrival(t: float | None) -> float | None:
        return None if t is None else (t - request.arrival_time) * 1000

    return Timings(
        queue_ms=since_arrival(request.first_scheduled_time or now) or 0.0,
        ttft_ms=since_arrival(request.first_token_time),
        e2e_ms=(now - request.arrival_time) * 1000,
    )
