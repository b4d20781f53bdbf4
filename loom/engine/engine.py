"""The trio engine: an admission task and a stepping loop over one scheduler and one model runner.

    submit() ──▶ Admission ── admission task: tokenise, check ──▶ admit: scheduler.add_request
                                                                          │
    stepping loop: expire deadlines and stalls ──▶ scheduler.schedule ────┘
        │ SchedulerOutput (plain data)
        ▼
    worker thread: runner.execute_model (forward, LM head on sampling rows, sample)
        │ ModelRunnerOutput (plain data)
        ▼
    scheduler.update: tokens applied, token stops finished and freed
        │ requests that advanced
        ▼
    OutputProcessor: detokenise, stop strings ──▶ RequestStream.push (never waits)

The stepping loop owns all request state between steps. Aborts and resumes from consumers run
in the trio thread and take effect at once; a request finished while its step runs keeps its
finish. However `run` ends (drain, cancel or crash) every live request ends with an error and its
blocks are freed. Steps, tokens, ended requests and refusals are counted in `EngineMetrics`
(loom/engine/metrics.py), and each ended request logs a line.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from functools import partial

import trio

from loom.core.block_manager import BlockManager
from loom.core.config import CacheConfig
from loom.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from loom.core.output_processor import OutputProcessor
from loom.core.prompt import Prompt
from loom.core.request import Request, RequestStatus
from loom.core.request_output import FinishReason, Logprobs, RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.core.scheduler import Scheduler
from loom.core.step import SchedulerOutput
from loom.engine.admission import Admission, Submission
from loom.engine.config import EngineConfig
from loom.engine.metrics import EngineMetrics, log_request
from loom.engine.request_stream import RequestStream
from loom.engine.stats import EngineStats, ModelInfo
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner

log = logging.getLogger(__name__)
RunnerFactory = Callable[[LoadedModel, CacheConfig], ModelRunner]


class EngineState(enum.Enum):
    """The engine's life; each value is why a submission is refused in that state."""

    LOADING = "the model is still loading"
    SERVING = "serving"
    DRAINING = "the engine is draining"
    STOPPED = "the engine stopped"  # or the crash, in `Engine.stop_reason`


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        load: Callable[[], LoadedModel],
        *,
        make_runner: RunnerFactory = ModelRunner,  # tests inject faults through a subclass
    ) -> None:
        self.config = config
        self.load = load
        self.make_runner = make_runner
        self.state = EngineState.LOADING
        self.stop_reason = EngineState.STOPPED.value  # set by `stop`: a crash says what it was
        self.loaded = False  # the runner, scheduler, admission and output processor exist
        self.streams: dict[str, RequestStream] = {}  # admitted, unfinished requests
        self.wakeup = trio.Event()
        self.limiter = trio.CapacityLimiter(1)
        self.metrics = EngineMetrics()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, allocate the KV pool, then serve until drained, cancelled or crashed."""
        reason = EngineState.STOPPED.value
        try:
            loaded = await trio.to_thread.run_sync(self.load)
            runner = await trio.to_thread.run_sync(self.make_runner, loaded, self.config.cache)
            self.open(loaded, runner)
            del loaded  # the transformers model: the runner keeps what it computes with
            task_status.started()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.admission_task)
                nursery.start_soon(self.stepping_loop)
        except Exception as exc:
            log.exception("the engine crashed")
            # Clients get the kind of fault only: its message may hold another client's data.
            reason = f"the engine crashed ({type(innermost(exc)).__name__}); see the server log"
            raise
        finally:
            self.stop(reason)

    def open(self, loaded: LoadedModel, runner: ModelRunner) -> None:
        self.runner = runner
        blocks = BlockManager(
            runner.num_blocks,
            runner.block_size,
            enable_caching=self.config.cache.enable_prefix_caching,
        )
        self.scheduler = Scheduler(self.config.scheduler, blocks)
        self.admission = Admission.for_model(self.config, loaded, runner, self.scheduler)
        self.outputs = OutputProcessor(loaded.tokenizer)
        self.model_name = loaded.name
        self.admission.on_refused = self.metrics.refused
        # A scrape, in its own thread, reads the stats in this one.
        token = trio.lowlevel.current_trio_token()
        self.metrics.opened(
            loaded.name, partial(trio.from_thread.run_sync, self.stats, trio_token=token)
        )
        self.loaded = True
        if self.state is EngineState.LOADING:
            self.state = EngineState.SERVING
        else:  # drained while it loaded
            self.admission.close()

    # The request API, called in the trio thread.

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        deadline: float | None = None,
        cache_salt: str = "",
    ) -> RequestStream:
        """Queue a request; its outputs arrive in the returned stream, whose `request_id` is the
        engine's own. Raises at once EngineDeadError when the engine is not serving,
        InvalidRequestError for a prompt too large, EngineOverloadedError when the queue is full;
        later refusals (after tokenising) end the stream with the error."""
        try:
            if self.state is not EngineState.SERVING:
                raise EngineDeadError(self.refusal())
            return self.admission.submit(
                prompt,
                sampling or SamplingParams(),
                deadline=deadline,
                cache_salt=cache_salt,
                abort=self.abort,
                resume=self.resume,
            )
        except (EngineDeadError, InvalidRequestError, EngineOverloadedError) as exc:
            self.metrics.refused(exc)
            raise

    @asynccontextmanager
    async def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        deadline: float | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[AsyncIterator[RequestOutput]]:
        """`async with engine.generate(...) as outputs: async for output in outputs: ...`

        Leaving the block early, by cancellation or an error, aborts the request."""
        stream = self.submit(prompt, sampling, deadline=deadline, cache_salt=cache_salt)
        try:
            async with aclosing(stream.outputs()) as outputs:
                yield outputs
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Finish a request as ABORTED and free its blocks. Safe for unknown or finished ids."""
        if not self.loaded:
            return
        if self.admission.abort(request_id):  # not admitted yet: the admission task drops it
            self.outputs.finished[FinishReason.ABORTED] += 1
            self.metrics.cancelled()
            return
        request = self.scheduler.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED, error="aborted")
            self.wakeup.set()

    def resume(self, request_id: str) -> None:
        """The consumer drained a full buffer: schedule the request again."""
        if self.loaded and self.scheduler.resume(request_id):
            self.wakeup.set()

    def drain(self) -> None:
        """Take no new requests; `run` returns once the admitted ones have finished."""
        if self.state in (EngineState.LOADING, EngineState.SERVING):
            self.state = EngineState.DRAINING
        if self.loaded:
            self.admission.close()

    def stats(self) -> EngineStats:
        self.check_loaded()
        return EngineStats.of(self.scheduler, self.outputs, num_pending=len(self.admission.pending))

    def model_info(self) -> ModelInfo:
        self.check_loaded()
        max_model_len = self.admission.prompts.max_model_len
        return ModelInfo.of(self.model_name, self.runner, max_model_len, self.config)

    def check_loaded(self) -> None:
        if not self.loaded:
            raise EngineDeadError(self.refusal())

    def refusal(self) -> str:
        return self.stop_reason if self.state is EngineState.STOPPED else self.state.value

    # The admission task and the stepping loop.

    async def admission_task(self) -> None:
        await self.admission.run(self.admit)
        self.wakeup.set()  # done: the stepping loop may end

    def admit(self, submission: Submission, request: Request) -> None:
        self.streams[request.request_id] = submission.stream
        self.outputs.add_request(request)
        self.scheduler.add_request(request)
        self.wakeup.set()

    async def stepping_loop(self) -> None:
        while True:
            self.wakeup = trio.Event()
            self.expire(trio.current_time())
            output = self.scheduler.schedule(trio.current_time())
            if output is not None:
                await self.step(output)
            elif self.admission.done and not self.scheduler.has_unfinished():
                return
            else:
                with trio.move_on_at(self.scheduler.next_timer(self.config.stall_timeout)):
                    await self.wakeup.wait()

    async def step(self, output: SchedulerOutput) -> None:
        start = time.perf_counter()
        result = await trio.to_thread.run_sync(
            self.runner.execute_model, output, limiter=self.limiter, abandon_on_cancel=False
        )
        self.metrics.stepped(len(output.sequences), time.perf_counter() - start)
        now = trio.current_time()
        for request, logprobs in self.scheduler.update(output, result, now):
            self.publish(request, logprobs, now)

    def publish(self, request: Request, logprobs: Logprobs | None, now: float) -> None:
        """Send a request's new token; a stop string in its text finishes it."""
        delta = self.outputs.new_token(request, logprobs)
        self.metrics.token(request, now)
        if delta.finished:  # a stop string
            self.scheduler.finish(request, RequestStatus.FINISHED_STOP_SEQUENCE)
        if request.finished:
            self.end_stream(request, now, delta)
        elif self.streams[request.request_id].push(delta):
            self.scheduler.pause(request, now)  # the consumer's buffer is full

    def expire(self, now: float) -> None:
        for request, status, error in self.scheduler.expired(now, self.config.stall_timeout):
            self.finish(request, status, error=error)

    def finish(self, request: Request, status: RequestStatus, *, error: str) -> None:
        if self.scheduler.finish(request, status, error):
            self.end_stream(request, trio.current_time())

    def end_stream(self, request: Request, now: float, delta: RequestOutput | None = None) -> None:
        final = self.outputs.final(request, now, delta)
        self.metrics.ended(request, now)
        log_request(request, final)
        self.streams.pop(request.request_id).push(final)

    def stop(self, reason: str) -> None:
        """End every live request with an error; take no new ones."""
        self.state, self.stop_reason = EngineState.STOPPED, reason
        if self.loaded:
            for request in list(self.scheduler.requests.values()):
                self.finish(request, RequestStatus.FINISHED_ERROR, error=reason)
            self.admission.close(EngineDeadError(reason))
        for stream in self.streams.values():  # finished in a step that then crashed mid-publish
            stream.fail(EngineDeadError(reason))
        self.streams.clear()


def innermost(exc: BaseException) -> BaseException:
    """The first exception inside nested exception groups (a crash comes out of nurseries)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
