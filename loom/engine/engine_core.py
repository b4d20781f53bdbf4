"""What the engine works with once its model is loaded, built whole at once: the model runner,
the scheduler (with its block manager and output processor), admission, and the streams of the
admitted requests; and the loop that steps them.

    submit ──▶ Admission ── admission task: tokenise, check ──▶ admit: scheduler.add_request
                                                                          │
    stepping loop: expire deadlines and stalls ──▶ scheduler.schedule ────┘
        │ SchedulerOutput (plain data)
        ▼
    worker thread: runner.execute_model (forward, LM head on sampling rows, sample)
        ‖ and another, for a step with constrained rows: their token masks (Grammars.fill)
        │ ModelRunnerOutput (plain data)
        ▼
    scheduler.update, one pass: tokens applied, detokenised, every stop made, finished
        │ (request, delta or final output), each request that received a token
        ▼
    publish: push the delta (pausing a request whose buffer is full), or end the stream

The stepping loop owns all request state between steps. Aborts and resumes from consumers run
in the trio thread and take effect at once; a request finished while its step runs keeps its
finish. Every event counted (steps, tokens, refusals, ended requests) goes to one observer
(loom/engine/observer.py), which also publishes the stats a scrape reads.
"""

from __future__ import annotations

import time
from collections import Counter

import trio

from loom.core.block_manager import BlockManager
from loom.core.errors import EngineDeadError
from loom.core.expiry import expired, next_timer
from loom.core.fair_share import service
from loom.core.output_processor import OutputProcessor
from loom.core.request import Request, RequestStatus
from loom.core.request_output import FinishReason, RequestOutput
from loom.core.scheduler import Scheduler
from loom.core.step import SchedulerOutput
from loom.engine.admission import Admission, Submission
from loom.engine.config import EngineConfig
from loom.engine.observer import Observer
from loom.engine.request_stream import RequestStream
from loom.engine.stats import EngineStats
from loom.model.grammar import Drafted, GrammarMatcher
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner

STATS_EVERY = 0.1  # seconds between the stats published for scrapes while stepping


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        runner: ModelRunner,
        observer: Observer,
    ) -> None:
        self.config = config
        self.runner = runner
        self.observer = observer
        self.loaded = loaded
        self.model_name = loaded.name
        blocks = BlockManager(
            runner.num_blocks,
            runner.block_size,
            enable_caching=config.cache.enable_prefix_caching,
            sliding_window=runner.kv_window,
        )
        self.scheduler = Scheduler(config.scheduler, blocks, OutputProcessor(loaded.tokenizer))
        self.admission = Admission.for_model(
            config, loaded, runner, self.scheduler, refused=observer.refused, push_out=self.push_out
        )
        self.streams: dict[str, RequestStream] = {}  # admitted, unfinished requests
        self.wakeup = trio.Event()
        self.limiter = trio.CapacityLimiter(1)

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.admission_task)
            nursery.start_soon(self.stepping_loop)

    async def admission_task(self) -> None:
        await self.admission.run(self.admit)
        self.wakeup.set()  # done: the stepping loop may end

    def admit(self, submission: Submission, request: Request) -> None:
        self.observer.admitted(request)
        self.streams[request.request_id] = submission.stream
        self.scheduler.add_request(request)
        self.wakeup.set()

    async def stepping_loop(self) -> None:
        while True:
            self.wakeup = trio.Event()
            self.expire(trio.current_time())
            output = self.scheduler.schedule(trio.current_time())
            if output is not None:
                self.publish_stats(every=STATS_EVERY)
                await self.step(output)
            elif self.admission.done and not self.scheduler.has_unfinished():
                self.publish_stats()
                return
            else:
                self.publish_stats()
                with trio.move_on_at(
                    next_timer(self.scheduler.requests.values(), self.config.stall_timeout)
                ):
                    await self.wakeup.wait()

    async def step(self, output: SchedulerOutput) -> None:
        start = time.perf_counter()
        matchers = self.constrained(output)
        # The constrained rows' masks, on a thread of their own while the forward runs; the
        # runner's thread waits for them after the forward (and gets a fill's error).
        grammars = self.admission.grammars
        masks = grammars.masking.submit(grammars.fill, matchers) if matchers else None
        result = await trio.to_thread.run_sync(
            self.runner.execute_model,
            output,
            masks.result if masks else None,
            limiter=self.limiter,
            abandon_on_cancel=False,
        )
        took = time.perf_counter() - start
        self.observer.stepped(len(output.sequences), took)
        # Each constrained row's tenant pays for what its token cost the grammar (its mask,
        # and its consume in `update`: Matcher.step_seconds) as for the service the step gave
        # in as much time: a step that served `units` (loom/core/fair_share.py) in `took`
        # seconds charges s seconds of grammar s * units / took more.
        units = (
            sum(service(len(s.token_ids), s.sampling is not None) for s in output.sequences)
            if matchers
            else 0.0
        )
        now = trio.current_time()
        for request, out in self.scheduler.update(output, result, now, units / max(took, 1e-9)):
            self.publish(request, out, now)
        if matchers:  # the step's grammar time, all rows together
            self.observer.masked(sum(m.step_seconds for m, _ in matchers))

    def constrained(self, output: SchedulerOutput) -> list[Drafted]:
        """The matchers of the step's constrained sampling sequences, with their drafts, in the
        sampler's order (none skipped: a row dropped here would shift every later row's mask)."""
        matchers = []
        for seq in output.sequences:
            if seq.sampling is None or not seq.sampling.constrained:
                continue
            matcher = self.scheduler.requests[seq.request_id].matcher
            if not isinstance(matcher, GrammarMatcher):
                raise TypeError(f"a constrained row's matcher is {type(matcher).__name__}")
            matchers.append((matcher, seq.draft_token_ids))
        return matchers

    def publish(self, request: Request, output: RequestOutput, now: float) -> None:
        """A request's new tokens of a step: pushed to its stream (pausing the request when the
        stream is full), or, the request finished, its stream ended."""
        self.observer.token(request, len(output.token_ids), now)
        if output.finished:
            self.end_stream(request, output, now)
        elif self.streams[request.request_id].push(output):
            self.scheduler.pause(request, now)

    def expire(self, now: float) -> None:
        requests = self.scheduler.requests.values()
        for request, status, error in expired(requests, now, self.config.stall_timeout):
            self.finish(request, status, error=error)

    def finish(self, request: Request, status: RequestStatus, *, error: str) -> None:
        """End a request that no token ended (an abort, a deadline, a stall, shutdown)."""
        if self.scheduler.finish(request, status, error):
            now = trio.current_time()
            self.end_stream(request, self.scheduler.outputs.final(request, now), now)

    def push_out(self, request: Request, why: str) -> None:
        """A queued request's place taken by a tenant below its share (loom/engine/admission.py)."""
        self.observer.pushed(request)
        self.finish(request, RequestStatus.FINISHED_REFUSED, error=why)

    def end_stream(self, request: Request, final: RequestOutput, now: float) -> None:
        self.observer.ended(request, final, now)
        self.streams.pop(request.request_id).push(final)

    def abort(self, request_id: str) -> None:
        """Finish a request as ABORTED and free its blocks. Safe for unknown or finished ids."""
        if self.admission.abort(request_id):  # not admitted yet: the admission task drops it
            self.scheduler.finished[FinishReason.ABORTED] += 1
            self.observer.cancelled()
            return
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED, error="aborted")
            self.wakeup.set()

    def resume(self, request_id: str) -> None:
        """The consumer drained a full buffer: schedule the request again."""
        if self.scheduler.resume(request_id):
            self.wakeup.set()

    def stats(self, tenant: str | None = None) -> EngineStats:
        """The figures; by tenant, every tenant's or (`tenant`) that one's alone."""
        return self.observer.stats(self.scheduler, self.pending(), tenant)

    def publish_stats(self, every: float = 0.0) -> None:
        """After each schedule: the state may have changed (`Engine.until`), and the stats for
        scrapes are published if due (the pending requests counted only then)."""
        self.observer.state_changed()
        self.observer.publish(self.scheduler, self.pending, every)

    def pending(self) -> Counter[str]:
        """Requests submitted and not yet admitted, by tenant."""
        return Counter(s.tenancy.tenant for s in self.admission.pending.values())

    def stop(self, reason: str) -> None:
        """End every live request with an error; take no new ones."""
        for request in list(self.scheduler.requests.values()):
            self.finish(request, RequestStatus.FINISHED_ERROR, error=reason)
        self.admission.close(EngineDeadError(reason))
        for stream in self.streams.values():  # finished in a step that then crashed mid-publish
            stream.fail(EngineDeadError(reason))
        self.streams.clear()
