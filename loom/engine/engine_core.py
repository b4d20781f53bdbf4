"""What the engine works with once its model is loaded, built whole at once: the model runner,
the scheduler (with its block manager and output processor), admission, and the streams of the
admitted requests; and the loop that steps them.

    submit ──▶ Admission ── admission task: tokenise, check ──▶ admit: scheduler.add_request
                                                                          │
    stepping loop: expire deadlines and stalls ──▶ scheduler.schedule ────┘
        │ SchedulerOutput N + 1 (plain data)
        ▼
    the model's thread (loom/engine/step_worker.py): runner.launch (forward, LM head on
        ‖ sampling rows, sample), the moment N is launched; and another, for a step with
        ‖ constrained rows: their masks (Grammars.fill)
        │ meanwhile, on the trio thread, step N lands: its ModelRunnerOutput (plain data)
        ▼
    scheduler.update, one pass: tokens applied, detokenised, every stop made, finished
        │ (request, delta or final output), each request that received a token
        ▼
    publish: push the delta (pausing a request whose buffer is full), or end the stream

Steps overlap (`--async-scheduling`, vLLM's): step N + 1 is scheduled and launched before step
N's result is applied, so the device (or on a CPU the worker thread) computes N + 1 while the
trio thread applies, detokenises and publishes N. It goes ahead only where N + 1 needs
nothing of N's tokens but their places (loom/core/overlap.py); else N lands first. The
stepping loop owns all request state between steps. Aborts and resumes from consumers run in
the trio thread and take effect at once; a request finished while its step runs keeps its
finish. Every event counted (steps, tokens, refusals, ended requests) goes to one observer
(loom/engine/observer.py), which also publishes the stats a scrape reads.
"""

from __future__ import annotations

import time
from collections import Counter

import attrs
import trio

from loom.core.block_manager import BlockManager
from loom.core.errors import EngineDeadError
from loom.core.expiry import expired, next_timer
from loom.core.fair_share import service
from loom.core.output_processor import OutputProcessor
from loom.core.overlap import step_runs_ahead
from loom.core.request import Request, RequestStatus
from loom.core.request_output import FinishReason, RequestOutput
from loom.core.scheduler import Scheduler
from loom.core.step import SchedulerOutput
from loom.engine.admission import Admission, Submission
from loom.engine.config import EngineConfig
from loom.engine.observer import Observer
from loom.engine.request_stream import RequestStream
from loom.engine.stats import EngineStats
from loom.engine.step_worker import Flight, StepWorker, step_worker
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
        steps = config.scheduler
        if steps.async_scheduling is None:  # overlapped where the step leaves the CPU free
            steps = attrs.evolve(steps, async_scheduling=runner.frees_cpu)
        self.scheduler = Scheduler(steps, blocks, OutputProcessor(loaded.tokenizer))
        self.admission = Admission.for_model(
            config, loaded, runner, self.scheduler, refused=observer.refused, push_out=self.push_out
        )
        self.streams: dict[str, RequestStream] = {}  # admitted, unfinished requests
        self.wakeup = trio.Event()

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
        request.output_room = submission.stream.room
        self.scheduler.add_request(request)
        self.wakeup.set()

    async def stepping_loop(self) -> None:
        """Schedule, launch, apply, publish; one step ahead where the step allows
        (loom/core/overlap.py): step N + 1 is handed to the model's thread before step N's
        result is applied, and N's tokens are applied, detokenised and published while N + 1
        runs."""
        async with step_worker(self.runner.launch) as worker:
            flight: Flight | None = None  # launched, and not yet applied
            while True:
                self.wakeup = trio.Event()
                self.expire(trio.current_time())
                ahead = flight is None or self.runs_ahead(flight)
                launched = self.launch(worker) if ahead else None
                if flight is not None:
                    await self.land(flight)
                elif launched is None:
                    self.publish_stats()
                    if self.admission.done and not self.scheduler.has_unfinished():
                        return
                    with trio.move_on_at(
                        next_timer(self.scheduler.requests.values(), self.config.stall_timeout)
                    ):
                        await self.wakeup.wait()
                flight = launched

    def runs_ahead(self, flight: Flight) -> bool:
        """Whether the next step may be launched before `flight` is applied."""
        scheduler = self.scheduler
        return step_runs_ahead(scheduler.config, scheduler.requests, flight.output)

    def launch(self, worker: StepWorker) -> Flight | None:
        """The next step, scheduled and handed to the model's thread (which launches it once
        the step before is launched: a pending token is the last launch's); None if there is
        nothing to step. A step with constrained rows has their masks filled on a thread of
        their own meanwhile; the runner waits for them after the forward."""
        output = self.scheduler.schedule(trio.current_time())
        if output is None:
            return None
        self.publish_stats(every=STATS_EVERY)
        matchers, grammars = self.constrained(output), self.admission.grammars
        masks = grammars.masking.submit(grammars.fill, matchers) if matchers else None
        flight = Flight(output, matchers, masks.result if masks else None)
        worker.submit(flight)
        return flight

    async def land(self, flight: Flight) -> None:
        """A launched step's result applied (`Scheduler.update`) and published."""
        await flight.launched.wait()
        launched = flight.launched_result()
        if launched.ready():
            result = launched.output()
        else:  # the device's copy of its tokens is not in yet: waited for off the event loop
            result = await trio.to_thread.run_sync(launched.output, abandon_on_cancel=False)
        output, matchers = flight.output, flight.matchers
        took = time.perf_counter() - flight.start
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
            return
        stream = self.streams[request.request_id]
        if stream.push(output):
            self.scheduler.pause(request, now)
        request.output_room = stream.room  # (a consumer may take some at once: it only grows)

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
            self.scheduler.requests[request_id].output_room = self.streams[request_id].room
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
