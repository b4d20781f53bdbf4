"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

Each request has `num_computed_tokens` (K/V in the pool) catching up with `num_tokens` (prompt +
output). Every step hands out at most `max_num_batched_tokens` tokens over at most
`max_num_seqs` sequences. There is no separate prefill phase: a running request gets what it
lacks, up to the budget left (a decode needs one token, a long prompt takes a chunk), so prompts
are prefilled in chunks alongside running decodes. A request whose tokens are all computed
after a step samples a new token.

Order: running requests first, in arrival order, skipping paused ones (their consumer's buffer
is full). When a running request cannot get blocks, a victim is preempted: its blocks are freed,
its progress forgotten (it recomputes prompt + output later) and it goes back to the front of the
queue. Victims: paused requests first, then the latest arrival. Waiting requests are admitted
only in steps that preempted nothing; a preempted request resumes only when blocks for all its
tokens are free, so that it does not thrash.
"""

from __future__ import annotations

from collections import deque

import attrs

from loom.block_manager import BlockManager
from loom.model_runner import ScheduledSequence
from loom.request import Request, RequestStatus


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    max_num_batched_tokens: int = attrs.field(default=512, validator=attrs.validators.ge(1))


@attrs.frozen(kw_only=True)
class SchedulerOutput:
    """The only contract between the scheduler and the stepping task."""

    sequences: tuple[ScheduledSequence, ...]
    requests: tuple[Request, ...]  # aligned with `sequences`
    sample_index: tuple[int, ...]  # sequences that catch up and so sample a token


@attrs.define
class Scheduler:
    config: SchedulerConfig
    block_manager: BlockManager
    waiting: deque[Request] = attrs.field(factory=deque)
    running: list[Request] = attrs.field(factory=list)
    num_preemptions: int = 0
    num_chunked_prefills: int = 0  # prompt chunks that left part of their prompt for later

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> list[Request]:
        return [*self.waiting, *self.running]

    def schedule(self, now: float) -> SchedulerOutput | None:
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        num_preemptions = self.num_preemptions
        for request in list(self.running):
            if budget == 0:
                break
            if request.paused or request.status is not RequestStatus.RUNNING:
                continue  # paused, or preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.reserve(request, num_new, [r for r, _ in chosen]):
                chosen.append((request, num_new))
                budget -= num_new
        if self.num_preemptions == num_preemptions:
            self.admit_waiting(chosen, budget)
        if not chosen:
            return None
        for request, _ in chosen:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
        return self.make_output(chosen)

    def reserve(self, request: Request, num_new: int, keep: list[Request]) -> bool:
        """Blocks for `num_new` more tokens of a running request, preempting others if need be.

        False when the request itself had to be preempted."""
        while not self.block_manager.allocate(
            request.request_id, request.num_computed_tokens + num_new
        ):
            victim = self.pick_victim(exclude=keep)
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def pick_victim(self, exclude: list[Request]) -> Request:
        candidates = [r for r in self.running if r not in exclude]
        paused = [r for r in candidates if r.paused]
        return paused[0] if paused else candidates[-1]

    def preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def admit_waiting(self, chosen: list[tuple[Request, int]], budget: int) -> None:
        for request in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if request.paused:
                continue  # preempted while its consumer was not reading: wait for a resume
            if request.status is RequestStatus.PREEMPTED and not self.block_manager.can_allocate(
                request.request_id, request.num_tokens + 1
            ):
                return
            num_new = min(request.num_tokens, budget)
            if not self.block_manager.allocate(request.request_id, num_new):
                return
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append((request, num_new))
            budget -= num_new

    def make_output(self, chosen: list[tuple[Request, int]]) -> SchedulerOutput:
        sequences, sample_index = [], []
        for i, (request, num_new) in enumerate(chosen):
            start = request.num_computed_tokens
            end = start + num_new
            if end == request.num_tokens:
                sample_index.append(i)
            elif end < request.num_prompt_tokens:
                self.num_chunked_prefills += 1
            sequences.append(
                ScheduledSequence(
                    request_id=request.request_id,
                    token_ids=tuple(request.all_token_ids[start:end]),
                    num_computed_tokens=start,
                    block_table=self.block_manager.block_table(request.request_id),
                )
            )
        return SchedulerOutput(
            sequences=tuple(sequences),
            requests=tuple(r for r, _ in chosen),
            sample_index=tuple(sample_index),
        )

    def update(self, output: SchedulerOutput, sampled: list[int]) -> list[int]:
        """Record a finished step: computed tokens, then the tokens sampled for `sample_index`.

        Requests finished while the step ran (aborted, expired) are left as they are: their
        finish wins over the step. Returns the indices into `sampled` of the tokens kept."""
        for request, seq in zip(output.requests, output.sequences, strict=True):
            if not request.finished:
                request.num_computed_tokens += len(seq.token_ids)
        kept = []
        for j, (i, token) in enumerate(zip(output.sample_index, sampled, strict=True)):
            request = output.requests[i]
            if not request.finished:
                request.output_token_ids.append(token)
                kept.append(j)
        return kept

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> bool:
        """End a request and free its blocks. Idempotent: False if it had already finished."""
        if request.finished:
            return False
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        request.error = error
        self.block_manager.free(request.request_id)
        return True

    def expired(self, now: float, stall_timeout: float) -> list[tuple[Request, RequestStatus]]:
        """Requests whose deadline passed, or whose consumer stalled past the timeout."""
        found = []
        for request in self.requests():
            if request.deadline is not None and now >= request.deadline:
                found.append((request, RequestStatus.FINISHED_DEADLINE))
            elif request.paused_since is not None and now - request.paused_since >= stall_timeout:
                found.append((request, RequestStatus.FINISHED_STALLED))
        return found

    def next_timer(self, stall_timeout: float) -> float:
        """The earliest deadline or stall expiry, or +inf."""
        times = [r.deadline for r in self.requests() if r.deadline is not None]
        times += [
            r.paused_since + stall_timeout for r in self.requests() if r.paused_since is not None
        ]
        return min(times, default=float("inf"))
