"""One step's contract between the scheduler and the model runner, both ways, as frozen data.

Into the worker thread goes a `SchedulerOutput`: for each scheduled sequence the tokens to
compute, where its K/V live, and, when those tokens complete the request so far, what the
sampler needs to pick its next token. Out comes a `ModelRunnerOutput`: one sampled token (and
its logprobs, if asked) for each sequence that samples, in step order, and the prompt
log-probabilities of the chunks that asked for them. A sequence with draft tokens
(speculative decoding, loom/core/speculative.py) samples at each of its k + 1 positions and
emits its accepted drafts and the token after them: 1 to k + 1 tokens, one after another.
No live request object crosses the thread; the scheduler applies the result
(`Scheduler.update`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from loom.core.pooling import PoolRows
from loom.core.request import PromptScoring, Request
from loom.core.request_output import Logprobs
from loom.core.sampling_params import SamplingParams

PLACEHOLDER = 0  # a pending token's place in `token_ids`, until the runner fills it


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

    @property
    def argmax_only(self) -> bool:
        """Its token is the argmax of the raw logits: greedy, nothing that moves a logit
        (penalties, logit_bias, min_tokens still unmet, a grammar), no logprobs."""
        p = self.params
        unmoved = not (p.has_penalties or p.logit_bias or self.constrained)
        return (
            p.greedy and unmoved and p.logprobs is None and self.num_output_tokens >= p.min_tokens
        )

    @classmethod
    def of(cls, request: Request) -> SamplingInput:
        penalised = request.sampling.has_penalties
        return cls(
            params=request.sampling,
            num_output_tokens=len(request.output_token_ids) + request.num_output_placeholders,
            eos_token_ids=request.eos_token_ids,
            prompt_token_ids=request.prompt_token_ids if penalised else (),
            output_token_ids=tuple(request.output_token_ids) if penalised else (),
            constrained=request.matcher is not None,
        )

    def ahead(self, drafts: tuple[int, ...]) -> SamplingInput:
        """This row for the position after `drafts`, as if they had been sampled: its
        min_tokens count, its seeded noise's position and its penalties' tokens move on."""
        if not drafts:
            return self
        penalised = self.params.has_penalties
        return attrs.evolve(
            self,
            num_output_tokens=self.num_output_tokens + len(drafts),
            output_token_ids=self.output_token_ids + drafts if penalised else (),
        )


@attrs.frozen(kw_only=True)
class ScheduledSequence:
    """One request's share of a step: `token_ids` to compute on top of its cached tokens."""

    request_id: str
    # The new tokens: a prefill chunk, or one decode token and its draft tokens, if any.
    token_ids: tuple[int, ...]
    num_computed_tokens: int  # tokens already in the KV pool, before `token_ids`
    block_table: tuple[int, ...]  # blocks covering num_computed_tokens + len(token_ids)
    sampling: SamplingInput | None = None  # None: a prompt chunk with more to come samples nothing
    scoring: PromptScoring | None = None  # the prompt's logprobs asked for, and due here
    pooling: PoolRows | None = None  # an embedding's rows to pool (it never samples)
    draft_token_ids: tuple[int, ...] = ()  # the tail of `token_ids` to verify (sampling rows)
    # With a draft model (loom/model/drafter.py): the drafts it is to propose and append, and
    # the tokens before `token_ids` it has not computed (the last step kept all its drafts).
    num_draft_slots: int = 0
    draft_prefix: tuple[int, ...] = ()
    # Overlapped scheduling: its one token is the one its request samples in the step launched
    # before this one, not known when this was scheduled. `token_ids` holds a placeholder (0);
    # the runner puts that token in its place (ModelRunner.launch).
    pending_token: bool = False

    @property
    def computed_from(self) -> int:
        """The first position either model computes in this step."""
        return self.num_computed_tokens - len(self.draft_prefix)

    @classmethod
    def of(
        cls,
        request: Request,
        num_new: int,
        block_table: tuple[int, ...],
        drafts: Mapping[str, tuple[int, ...]],
        slots: Mapping[str, int],
    ) -> ScheduledSequence:
        """The request's next `num_new` tokens, and its drafts (by request id), or the number a
        draft model is to propose, if it has any."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        samples = end == request.num_tokens and request.sampling.pooling is None
        guess = drafts.get(request.request_id, ())
        known = min(end, request.num_known_tokens)
        pending = end - max(start, known)  # placeholders: 1 at most (a decode runs ahead)
        if pending > 1 or (pending and guess):
            raise ValueError(f"request {request.request_id}: {pending} placeholder tokens")
        return cls(
            request_id=request.request_id,
            token_ids=request.token_ids(start, known) + (PLACEHOLDER,) * pending + guess,
            num_computed_tokens=start,
            block_table=block_table,
            sampling=SamplingInput.of(request) if samples else None,
            scoring=request.prompt_scoring(start, end),
            pooling=request.pool_rows(start, end),
            draft_token_ids=guess,
            num_draft_slots=slots.get(request.request_id, 0),
            draft_prefix=request.token_ids(start - request.draft_lag, start),
            pending_token=pending > 0,
        )


@attrs.frozen(kw_only=True)
class SchedulerOutput:
    sequences: tuple[ScheduledSequence, ...]


@attrs.frozen(kw_only=True)
class ModelRunnerOutput:
    """The tokens each sequence of the step that samples emits, in the step's order: one, or,
    for a sequence with drafts, its accepted drafts and the token after them."""

    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprobs | None, ...]
    prompt_logprobs: Mapping[str, tuple[Logprobs, ...]] = attrs.field(factory=dict)
    drafts: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)  # each drafted row's
    pooled: Mapping[str, tuple[float, ...]] = attrs.field(factory=dict)  # embeddings' (PoolRows)

    def by_request(self) -> dict[str, list[tuple[int, Logprobs | None]]]:
        """Each request's emitted tokens, in order, with their logprobs."""
        emitted: dict[str, list[tuple[int, Logprobs | None]]] = {}
        for request_id, token_id, logprobs in zip(
            self.request_ids, self.token_ids, self.logprobs, strict=True
        ):
            emitted.setdefault(request_id, []).append((token_id, logprobs))
        return emitted


def check_scheduled(seq: ScheduledSequence, block_size: int) -> None:
    if not seq.token_ids:
        raise ValueError(f"request {seq.request_id}: no tokens scheduled")
    drafts = seq.draft_token_ids
    if drafts and (seq.sampling is None or seq.token_ids[-len(drafts) :] != drafts):
        raise ValueError(f"request {seq.request_id}: drafts must end a sampling row's tokens")
    if seq.pending_token and len(seq.token_ids) != 1:
        raise ValueError(f"request {seq.request_id}: a pending token goes alone")
    num_tokens = seq.num_computed_tokens + len(seq.token_ids)
    if len(seq.block_table) * block_size < num_tokens:
        raise ValueError(
            f"request {seq.request_id}: block table of {len(seq.block_table)} blocks cannot hold "
            f"{num_tokens} tokens at block size {block_size}"
        )
