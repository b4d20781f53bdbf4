"""Requests and step results built by hand for the sync unit tests."""

from __future__ import annotations

from loom.core.request import Request
from loom.core.sampling_params import SamplingParams
from loom.core.step import ModelRunnerOutput, SchedulerOutput


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
        prompt_token_ids=tuple(range(1, num_prompt + 1)),
        sampling=sampling,
        max_tokens=sampling.max_tokens or max_tokens,
        eos_token_ids=eos_token_ids,
        arrival_time=0.0,
    )


def sampled(output: SchedulerOutput, token_id: int = 7) -> ModelRunnerOutput:
    """What the runner would return for `output` if every sampling sequence drew `token_id`."""
    request_ids = tuple(s.request_id for s in output.sequences if s.sampling is not None)
    return ModelRunnerOutput(
        request_ids=request_ids,
        token_ids=(token_id,) * len(request_ids),
        logprobs=(None,) * len(request_ids),
    )


def speculated(output: SchedulerOutput, num_accepted: int, bonus: int = 7) -> ModelRunnerOutput:
    """What the runner would return if each sampling sequence accepted `num_accepted` of its
    drafts (at most all) and then drew `bonus`."""
    request_ids: list[str] = []
    token_ids: list[int] = []
    for seq in output.sequences:
        if seq.sampling is not None:
            kept = (*seq.draft_token_ids[:num_accepted], bonus)
            request_ids += [seq.request_id] * len(kept)
            token_ids += kept
    return ModelRunnerOutput(
        request_ids=tuple(request_ids),
        token_ids=tuple(token_ids),
        logprobs=(None,) * len(token_ids),
        drafts={s.request_id: s.draft_token_ids for s in output.sequences if s.draft_token_ids},
    )
