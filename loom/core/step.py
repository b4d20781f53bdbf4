"""One step's contract between the scheduler and the model runner, both ways, as frozen data.

Into the worker thread goes a `SchedulerOutput`: for each scheduled sequence the tokens to
compute, where its K/V live, and, when those tokens complete the request so far, what the
sampler needs to pick its next token. Out comes a `ModelRunnerOutput`: one sampled token (and
its logprobs, if asked) for each sequence that samples, in step order, and the prompt
log-probabilities of the chunks that asked for them. No live request object
crosses the thread; the scheduler applies the result (`Scheduler.update`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from loom.core.request import PromptScoring, Request
from loom.core.request_output import Logprobs
from loom.core.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class SamplingInput:
    """What the sampler needs of one request, copied out of it for this step. The token ids are
    what the penalties count: a request without penalties sends none (they cost a copy a step)."""

    params: SamplingParams
    num_output_tokens: int  # min_tokens; the position a seeded request's noise is drawn for
    eos_token_ids: tuple[int, ...]  # banned until min_tokens (unless ignore_eos)
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    constrained: bool = False  # its logits are masked to what its matcher allows

    @classmethod
    def of(cls, request: Request) -> SamplingInput:
        penalised = request.sampling.has_penalties
        return cls(
            params=request.sampling,
            num_output_tokens=len(request.output_token_ids),
            eos_token_ids=request.eos_token_ids,
            prompt_token_ids=request.prompt_token_ids if penalised else (),
            output_token_ids=tuple(request.output_token_ids) if penalised else (),
            constrained=request.matcher is not None,
        )


@attrs.frozen(kw_only=True)
class ScheduledSequence:
    """One request's share of a step: `token_ids` to compute on top of its cached tokens."""

    request_id: str
    token_ids: tuple[int, ...]  # the new tokens (a prefill chunk, or one decode token)
    num_computed_tokens: int  # tokens already in the KV pool, before `token_ids`
    block_table: tuple[int, ...]  # blocks covering num_computed_tokens + len(token_ids)
    sampling: SamplingInput | None = None  # None: a prompt chunk with more to come samples nothing
    scoring: PromptScoring | None = None  # the prompt's logprobs asked for, and due here


@attrs.frozen(kw_only=True)
class SchedulerOutput:
    sequences: tuple[ScheduledSequence, ...]


@attrs.frozen(kw_only=True)
class ModelRunnerOutput:
    """One token for each sequence of the step that samples, in the step's order."""

    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprobs | None, ...]
    prompt_logprobs: Mapping[str, tuple[Logprobs, ...]] = attrs.field(factory=dict)
