"""Requests built by hand for the sync unit tests."""

from __future__ import annotations

from loom.request import Request
from loom.sampling_params import SamplingParams


def make_request(
    request_id: str,
    num_prompt: int = 3,
    max_tokens: int = 100,
    *,
    sampling: SamplingParams | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> Request:
    sampling = sampling or SamplingParams(max_tokens=max_tokens)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, num_prompt + 1)),
        sampling=sampling,
        max_tokens=sampling.max_tokens or max_tokens,
        eos_token_ids=eos_token_ids,
        arrival_time=0.0,
    )
