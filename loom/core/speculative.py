"""Speculative decoding's settings and proposer: the draft tokens a step verifies.

A request in its decode phase computes one token a step and samples the next. With speculation
on, the scheduler asks the proposer for up to k draft tokens that may follow (k within the
step's token budget and the request's max_tokens, and only if blocks for them are free: a guess
never preempts). The step computes the last token and the drafts together, k + 1 positions in
one forward, and samples a token at each position as it would without drafts
(loom/model/model_runner.py). Draft i is accepted while the token sampled at its position
equals it; the tokens emitted are the accepted drafts and the token sampled after the last of
them, so a step gives 1 to k + 1 tokens. A one-hot draft accepted exactly when the target
samples it is rejection sampling (accept d with probability p(d); on a rejection the token
sampled is distributed as p without d): greedy output is token-identical to decoding without
drafts, sampled output keeps its distribution, and a seeded request its tokens. The K/V of
rejected drafts are overwritten next step and their blocks past the tokens kept released at
once (Scheduler.update). A request whose drafted steps keep none drafts less often: after 1, 2,
3, 4 such steps in a row it waits 1, 3, 7, 15 steps (its drafts cost the whole batch's step).

The n-gram proposer (prompt lookup: vLLM's `ngram`, llama.cpp's lookup decoding) finds the
longest suffix of the request's tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`,
that occurred before, takes its earliest occurrence, and proposes up to k tokens that followed
it. Worked example, tokens [1, 2, 3, 4, 2, 3], n in 1..2, k 3: the suffix [2, 3] occurred at
position 1; the tokens after it are [4, 2, 3]. The search is `bytearray.find` over the tokens
as 32-bit integers (each request's kept and extended as it grows): C's speed, no index to hold.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import attrs

from loom.core.block_manager import BlockManager
from loom.core.request import Request
from loom.core.request_output import Logprobs
from loom.core.setting import in_range, setting
from loom.core.step import ModelRunnerOutput, SamplingInput, ScheduledSequence

TOKEN_BYTES = array("i").itemsize  # 4
MAX_BACKOFF = 4  # at most 2 ** 4 - 1 steps without drafts after drafted steps that kept none
# A match at an offset that splits a token is skipped; a prompt built to make many of them
# makes the search retry, this many times at most for each n.
MAX_UNALIGNED = 8


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    speculative_method: str | None = setting(
        None,
        "speculative decoding: ngram (draft tokens looked up in the request's own prompt "
        "and output), or draft (drafted by the model's own weights in "
        "--speculative-quantization, e.g. q4 for the exact model); off when unset",
        choices=("ngram", "draft"),
    )
    speculative_quantization: str = setting(
        "q4",
        "the draft method's: how the draft model (the model's own weights) computes",
        choices=("none", "int8", "q4"),
    )
    num_speculative_tokens: int = setting(
        4,
        "most draft tokens a request verifies a step (its step attends at most 16 new tokens "
        "a sequence as decode rows)",
        check=in_range(1, 15),
    )
    prompt_lookup_max: int = setting(
        4, "longest n-gram the ngram method looks up", check=in_range(1, 16)
    )
    prompt_lookup_min: int = setting(
        2, "shortest n-gram the ngram method looks up", check=in_range(1, 16)
    )

    @property
    def draft_quantization(self) -> str | None:
        """The draft model's method, with the draft method on."""
        return self.speculative_quantization if self.speculative_method == "draft" else None

    def __attrs_post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )


@attrs.define
class Speculation:
    """The scheduler's side: drafts proposed, with blocks for them, and the verdicts counted
    (vLLM's spec_decode figures: acceptance rate = accepted / draft tokens, mean accepted
    length = 1 + accepted / drafts)."""

    config: SpeculativeConfig
    proposer: NgramProposer | None = attrs.field(init=False)
    num_drafts: int = 0  # steps of a request with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = attrs.field(init=False)  # accepted at draft position i

    def __attrs_post_init__(self) -> None:
        self.proposer = NgramProposer.of(self.config)
        self.accepted_per_pos = [0] * self.config.num_speculative_tokens

    def drafts(
        self, chosen: list[tuple[Request, int]], budget: int, blocks: BlockManager
    ) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
        """Draft tokens by request (n-gram), or the number of drafts the runner's draft model
        is to propose by request (`draft`), for the step's `chosen` requests that compute their
        one last token, in order, from the token `budget` the chosen requests' tokens leave and
        with blocks that are free (`allocate` never preempts): a guess never takes a token or
        a block a request needs. Each gets as many as max_tokens allows (a step emits one token
        more than it accepts). A constrained request's n-gram drafts are checked against its
        grammar with its masks (loom/model/grammar.py): those it refuses are never kept; the
        draft model drafts for none (its drafts come after the masks are begun)."""
        found: dict[str, tuple[int, ...]] = {}
        slots: dict[str, int] = {}
        method = self.config.speculative_method
        for request, num_new in chosen if method is not None else ():
            if budget <= 0:
                break
            if num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
                continue  # a prompt chunk
            constrained = request.matcher or request.held  # (held: it binds after thinking)
            if not request.sampling.speculative or (method == "draft" and constrained):
                continue
            if request.sampling.pooling is not None:
                continue  # an embedding: its prompt's last token, pooled, and nothing after
            if request.draft_pause > 0:  # its drafts missed lately: it waits
                request.draft_pause -= 1
                continue
            room = request.max_tokens - len(request.output_token_ids) - 1
            k = min(self.config.num_speculative_tokens, budget, room)
            drafts = self.proposer.propose(request, k) if self.proposer is not None else ()
            num = len(drafts) if method == "ngram" else k
            if num > 0 and blocks.allocate(request.request_id, request.num_tokens + num):
                if drafts:
                    found[request.request_id] = drafts
                else:
                    slots[request.request_id] = num
                budget -= num
        return found, slots

    def verified(
        self, request: Request, seq: ScheduledSequence, drafts: tuple[int, ...], num_emitted: int
    ) -> int:
        """The drafts a step accepted (it emitted those and one token more), counted. The
        draft model never computed the last of its drafts: if that is kept, it lacks its K/V
        (`draft_lag`, computed first next step)."""
        drafted = seq.num_draft_slots > 0 and len(drafts) > 0
        request.draft_lag = int(drafted and len(drafts) == num_emitted - 1)
        if not drafts:
            return 0
        num_accepted = max(num_emitted - 1, 0)
        # Back off from a request whose drafts miss: 1, 3, 7, then 15 steps without drafts
        # after 1, 2, 3, 4 or more drafted steps in a row that kept none.
        request.draft_misses = 0 if num_accepted else request.draft_misses + 1
        request.draft_pause = (1 << min(request.draft_misses, MAX_BACKOFF)) - 1
        request.num_drafts += 1
        request.num_draft_tokens += len(drafts)
        request.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        return num_accepted


@attrs.frozen
class NgramProposer:
    min_n: int
    max_n: int

    @classmethod
    def of(cls, config: SpeculativeConfig) -> NgramProposer | None:
        if config.speculative_method != "ngram":
            return None
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed the earliest occurrence of the longest suffix."""
        if k < 1:
            return ()
        data = token_bytes(request)
        num_tokens = len(data) // TOKEN_BYTES
        end = (num_tokens - 1) * TOKEN_BYTES  # a match ends before the last token: one follows
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            at = aligned_find(data, data[-n * TOKEN_BYTES :], end)
            if at is not None:
                start = at + n * TOKEN_BYTES
                return tuple(array("i", data[start : start + k * TOKEN_BYTES]))
        return ()


def aligned_find(data: bytearray, pattern: bytearray, end: int) -> int | None:
    """The first offset below `end - len(pattern)` where `pattern` starts on a token."""
    at = data.find(pattern, 0, end)
    for _ in range(MAX_UNALIGNED):
        if at < 0 or at % TOKEN_BYTES == 0:
            break
        at = data.find(pattern, at + 1, end)
    return at if at >= 0 and at % TOKEN_BYTES == 0 else None


def token_bytes(request: Request) -> bytearray:
    """The request's tokens (prompt, then output) as 32-bit integers, extended as it grows."""
    data = request.token_bytes
    have = len(data) // TOKEN_BYTES
    if have < request.num_tokens:
        data += array("i", request.token_ids(have, request.num_tokens)).tobytes()
    return data


def accepted(sampled: tuple[int, ...] | list[int], drafts: tuple[int, ...]) -> int:
    """How many drafts the sampled tokens accept: the length of their common start."""
    for i, (token, draft) in enumerate(zip(sampled, drafts, strict=False)):
        if token != draft:
            return i
    return min(len(sampled), len(drafts))


def sampling_rows(sequences: Sequence[ScheduledSequence]) -> list[SamplingInput]:
    """The sampler's rows for sampling sequences: one each, or k + 1 for one with k drafts,
    row i sampling as if drafts 1..i had been sampled before it."""
    return [
        s.sampling.ahead(s.draft_token_ids[:i])
        for s in sequences
        if s.sampling is not None
        for i in range(len(s.draft_token_ids) + 1)
    ]


def emitted(
    sequences: Sequence[ScheduledSequence],
    token_ids: list[int],
    logprobs: list[Logprobs | None],
    prompt_logprobs: dict[str, tuple[Logprobs, ...]] | None = None,
) -> ModelRunnerOutput:
    """The tokens sampling sequences emit, from their rows' sampled tokens (`sampling_rows`'
    order): each one's accepted drafts and the token sampled after the last of them."""
    request_ids: list[str] = []
    kept: list[int] = []
    kept_logprobs: list[Logprobs | None] = []
    at = 0
    for seq in sequences:
        drafts = seq.draft_token_ids
        num = accepted(token_ids[at : at + len(drafts)], drafts) + 1
        request_ids += [seq.request_id] * num
        kept += token_ids[at : at + num]
        kept_logprobs += logprobs[at : at + num]
        at += len(drafts) + 1
    return ModelRunnerOutput(
        request_ids=tuple(request_ids),
        token_ids=tuple(kept),
        logprobs=tuple(kept_logprobs),
        prompt_logprobs=prompt_logprobs or {},
        drafts={s.request_id: s.draft_token_ids for s in sequences if s.draft_token_ids},
    )
