"""Continuous batching with a token budget, chunked prefill and preemption by recompute.

Each request has `num_computed_tokens` (K/V in the pool) catching up with `num_tokens` (prompt +
output). Every step hands out at most `max_num_batched_tokens` tokens over at most
`max_num_seqs` sequences. There is no separate prefill phase: a running request gets what it
lacks, up to the budget left (a decode needs one token, a long prompt takes a chunk), so prompts
are prefilled in chunks alongside running decodes. A request whose tokens are all computed
after a step samples a new token. With speculative decoding a request in its decode phase
also computes draft tokens, of which `update` keeps the accepted (loom/core/speculative.py).

Order: running requests first, in arrival order, skipping paused ones (their consumer's buffer
is full). When a running request cannot get blocks, a victim is preempted: its blocks are freed,
its progress forgotten (it recomputes prompt + output later) and it goes back to the front of the
queue, paused requests first, then the policy's choice. Waiting requests are admitted only in
steps that preempted nothing; a preempted one resumes once blocks for all its tokens are free.
Constrained rows past the step's mask budget wait a step (loom/core/mask_budget.py). The
`scheduling_policy` (loom/core/policy.py: fair, priority, fcfs) orders admission, picks victims.

With prefix caching, a waiting request first takes the cached blocks that hold the longest run
of its full blocks (whole blocks only, never its last token: a step must compute at least one
token to sample from), counts them as computed and prefills only the rest; budgets and block
checks count only what it lacks. After each step, the blocks a step filled are cached under
their content hashes (loom/core/prefix_cache.py); those no later query reads are released.

A client that stops reading holds nothing others need: a paused request counts against neither
`max_num_seqs` nor the queue limits, and paused requests are preempted to make room for a
waiting one (they recompute once their consumer reads again).

The step goes one way: `schedule` makes a `SchedulerOutput` (plain data), counting its tokens
as computed and its sampled tokens as placeholders at once, so that the next step may be
scheduled before it is applied (overlapped scheduling, loom/core/overlap.py: a request in
flight is never preempted); the model runner returns a `ModelRunnerOutput`, and `update`
applies it in one pass: accepted drafts, then each sampled token, detokenised
(loom/core/output_processor.py), and every stop it makes (EOS, stop token ids, max_tokens,
which admission keeps within the context length, and stop strings): its output is a delta
or, for a request it finished, the final one. `finish` is the one place a request ends,
whatever ends it (a token stop, a stop string, an abort, a deadline, a stall, shutdown, a
refusal): its blocks are freed there, once. A request finished while its step runs keeps that
finish; the step's token for it is dropped (timers: loom/core/expiry.py).
"""

from __future__ import annotations

from collections import Counter, deque
from functools import partial

import attrs

from loom.core.block_manager import BlockManager
from loom.core.config import SchedulerConfig
from loom.core.fair_share import FairShare
from loom.core.mask_budget import within_mask_budget
from loom.core.output_processor import OutputProcessor
from loom.core.overlap import in_flight, waits_for_flight
from loom.core.policy import Policy, make_room, policy_named, victim_of
from loom.core.prefix_cache import cache_full_blocks, cached_prefix
from loom.core.request import FINISH_REASONS, Request, RequestStatus
from loom.core.request_output import FinishReason, RequestOutput
from loom.core.speculative import Speculation
from loom.core.step import ModelRunnerOutput, ScheduledSequence, SchedulerOutput

Chosen = list[tuple[Request, int]]  # a step's requests so far, with their new tokens' counts


@attrs.define
class Scheduler:
    config: SchedulerConfig
    block_manager: BlockManager
    outputs: OutputProcessor = attrs.field(factory=lambda: OutputProcessor(None))
    fair: FairShare = attrs.field(factory=FairShare)  # the service counted, whatever the policy
    policy: Policy = attrs.field(init=False)
    spec: Speculation = attrs.field(init=False)  # drafts, when speculative decoding is on
    requests: dict[str, Request] = attrs.field(factory=dict)  # unfinished: waiting or running
    waiting: deque[Request] = attrs.field(factory=deque)
    running: list[Request] = attrs.field(factory=list)
    num_preemptions: int = 0
    num_steps: int = 0
    num_chunked_prefills: int = 0  # prompt chunks that left part of their prompt for later
    num_prompt_tokens: int = 0  # of the requests added, all time
    num_generated_tokens: int = 0  # sampled and kept, all time
    prefix_cache_queries: int = 0  # tokens of the requests admitted (again after a preemption)
    prefix_cache_hits: int = 0  # of those, found in the prefix cache
    # Ended requests by finish reason, all time: in `finish`; by the engine, aborts before adding
    finished: Counter[FinishReason] = attrs.field(factory=Counter)

    def __attrs_post_init__(self) -> None:
        self.policy = policy_named(self.config.scheduling_policy, self.fair)
        self.spec = Speculation(self.config.speculative)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.outputs.add_request(request)
        self.waiting.append(request)
        self.num_prompt_tokens += request.num_prompt_tokens
        self.fair.added(request.tenant, request.tenancy.weight)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_active(self) -> int:
        """Running requests that are not paused: what `max_num_seqs` bounds."""
        return sum(not r.paused for r in self.running)

    def num_waiting(self) -> int:
        """Queued requests that are not paused: what the waiting-queue limits bound."""
        return sum(not r.paused for r in self.waiting)

    def num_waiting_tokens(self, tenant: str | None = None) -> int:
        """Prompt tokens of the queued requests that are not paused (`tenant`'s alone)."""
        queued = (r for r in self.waiting if not r.paused and tenant in (None, r.tenant))
        return sum(r.num_prompt_tokens for r in queued)

    def schedule(self, now: float) -> SchedulerOutput | None:
        budget = self.config.max_num_batched_tokens
        chosen: Chosen = []
        deferred: set[Request] = set()  # victims in flight: out of this step (overlap.py)
        for victim in self.policy.rebalance(self.waiting, self.running, self.config.max_num_seqs):
            if in_flight(victim):
                deferred.add(victim)
            else:
                self.preempt(victim)
        num_preemptions = self.num_preemptions
        for request in list(self.running):
            if budget == 0 or len(chosen) == self.config.max_num_seqs:
                break  # (running requests resumed from a pause can outnumber the slots)
            if request.paused or request.status is not RequestStatus.RUNNING:
                continue  # paused, or preempted earlier in this loop
            if waits_for_flight(request) or request in deferred:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.reserve(request, num_new, chosen, deferred):
                chosen.append((request, num_new))
                budget -= num_new
        if self.num_preemptions == num_preemptions:
            self.admit_waiting(chosen, budget)
        # Drafts last, from the budget and the free blocks left: no guess starves or preempts.
        budget = self.config.max_num_batched_tokens - sum(n for _, n in chosen)
        drafts, slots = self.spec.drafts(chosen, budget, self.block_manager)
        kept = within_mask_budget(chosen, self.config.step_mask_budget, self.policy, drafts)
        for request in {r for r, _ in chosen} - {r for r, _ in kept}:  # they wait a step:
            if drafts.pop(request.request_id, None) or slots.pop(request.request_id, None):
                self.block_manager.trim(request.request_id, request.num_tokens)
        if not (chosen := kept):
            return None
        self.num_steps += 1
        for request, num_new in chosen:
            request.last_step = self.num_steps
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            end = request.num_computed_tokens + num_new
            if end < request.num_prompt_tokens:
                self.num_chunked_prefills += 1  # leaves part of its prompt for later
            num_drafts = len(drafts.get(request.request_id, ())) + slots.get(request.request_id, 0)
            self.fair.served(request.tenant, num_new + num_drafts, end == request.num_tokens)
        table = self.block_manager.block_table
        scheduled = tuple(
            ScheduledSequence.of(r, n, table(r.request_id), drafts, slots) for r, n in chosen
        )
        for (request, num_new), seq in zip(chosen, scheduled, strict=True):
            request.scheduled(num_new, seq.sampling is not None)
        return SchedulerOutput(sequences=scheduled)

    def reserve(
        self, request: Request, num_new: int, chosen: Chosen, deferred: set[Request]
    ) -> bool:
        """Blocks for `num_new` more tokens of a running request, preempting others (not those
        already `chosen` for this step) if need be. False when the request itself had to be
        preempted, or the victim is in flight (it is `deferred`: preempted next step)."""
        while not self.block_manager.allocate(
            request.request_id, request.num_computed_tokens + num_new
        ):
            taken = {r for r, _ in chosen}
            victim = victim_of([r for r in self.running if r not in taken], self.policy)
            if in_flight(victim):  # its blocks are being written: it yields them next step
                deferred.add(victim)
                return False
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        if in_flight(request):  # (its blocks are being written: `reserve` defers it)
            raise ValueError(f"request {request.request_id} preempted with a step in flight")
        self.block_manager.free(request.request_id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = request.draft_lag = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def admit_waiting(self, chosen: Chosen, budget: int) -> None:
        bm = self.block_manager
        # Blocks for a request's tokens, after preempting paused ones that are not in flight
        # if that frees enough (loom/core/policy.py):
        idle = [r for r in self.running if not in_flight(r)]
        room = partial(make_room, bm, running=idle, policy=self.policy, preempt=self.preempt)
        num_active = self.num_active()  # counted once: this loop may see thousands waiting
        # Ordered on the first `next`: once there is room.
        order = self.policy.admission_order(self.waiting, self.running)
        while budget > 0 and num_active < self.config.max_num_seqs:
            if (request := next(order, None)) is None:
                return
            cached = cached_prefix(bm, request)
            num_cached = len(cached) * bm.block_size
            if request.status is RequestStatus.PREEMPTED and not room(
                request.request_id, request.num_tokens + 1, cached
            ):
                return
            num_new = min(request.num_tokens - num_cached, budget)
            if not (
                room(request.request_id, num_cached + num_new, cached)
                and bm.allocate(request.request_id, num_cached + num_new, cached)
            ):
                return
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:
                request.num_cached_tokens = num_cached
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
            self.running.append(request)
            chosen.append((request, num_new))
            budget -= num_new
            num_active += 1

    def update(
        self, output: SchedulerOutput, result: ModelRunnerOutput, now: float, rate: float = 0.0
    ) -> list[tuple[Request, RequestOutput]]:
        """Apply a finished step, in one pass: each request that received tokens, with its
        output (a delta, or the final output of a request a token ended: tokens after it are
        dropped), every stop applied (EOS, stop token ids, max_tokens, and stop strings, which
        win over a token stop on the same token, as in vLLM). A constrained token's tenant is
        charged what it cost the grammar at `rate` (loom/engine/engine_core.py), before a finish."""
        emitted, advanced = result.by_request(), []
        for seq in output.sequences:
            request = self.requests.get(seq.request_id)
            if request is None:
                continue  # finished while the step ran
            tokens, drafts = emitted.get(seq.request_id, []), result.drafts.get(seq.request_id, ())
            num_accepted = self.spec.verified(request, seq, drafts, len(tokens))
            request.applied(num_accepted, seq.sampling is not None)
            request.prompt_logprobs += result.prompt_logprobs.get(seq.request_id, ())
            request.pool(result.pooled.get(seq.request_id), seq.pooling)
            if request.deadline is not None and now >= request.deadline:
                tokens = []  # too late: dropped; `expired` finishes it as DEADLINE next
            taken = self.outputs.take(request, tokens, now)
            self.num_generated_tokens += taken.num_tokens
            self.fair.charge(request.tenant, taken.grammar_seconds * rate)
            delta, status = taken.delta, taken.status
            # K/V computed past a stop, or past </think> (the next mask needs its last token):
            ends = request.num_tokens - (delta is not None and status is None)
            request.num_computed_tokens = min(request.num_computed_tokens, ends)
            # What this step computed (a step ahead of it may have computed more), less what
            # the draft model's K/V lack:
            end = seq.num_computed_tokens + len(seq.token_ids) - len(seq.draft_token_ids)
            end += num_accepted
            done = min(end, request.num_computed_tokens) - request.draft_lag
            cache_full_blocks(self.block_manager, request, seq.computed_from, done)
            self.block_manager.slide(request.request_id, done)
            self.block_manager.trim(request.request_id, request.num_tokens)
            status = RequestStatus.FINISHED_STOPPED if request.embedded else status
            if status is not None and self.finish(request, status, request.stop_error()):
                delta = self.outputs.final(request, now, delta)
            if delta is not None:
                advanced.append((request, delta))
        return advanced

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> bool:
        """End a request and free its blocks. Idempotent: False if it had already finished."""
        if not status.finished:
            raise ValueError(f"{status.name} is not a finish")
        if request.finished:
            return False
        del self.requests[request.request_id]
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.error = error
        self.block_manager.free(request.request_id)
        self.finished[FINISH_REASONS[status]] += 1
        self.fair.finished(request.tenant)
        return True

    def pause(self, request: Request, now: float) -> None:
        """Its consumer's buffer is full: skip it until `resume`, abort it after a stall."""
        request.paused_since = now

    def resume(self, request_id: str) -> bool:
        """The consumer drained its buffer. False if the request was not paused (or is gone)."""
        request = self.requests.get(request_id)
        if request is None or not request.paused:
            return False
        request.paused_since = None
        return True
