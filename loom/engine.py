"""The trio engine: admission, scheduling and stepping tasks over memory channels.

    submit() ──admission channel──▶ admission task: tokenize, validate, bound the queue
                                        │ scheduler.add_request
                                        ▼
                                scheduling task ──SchedulerOutput──▶ stepping task
                                   ▲    │                               │ worker thread:
                                   │    └── outputs ▶ RequestStream     │ forward + sample
                                   └──────────── SamplerOutput ◀────────┘

The scheduling task owns all request state: it expires deadlines and stalled consumers, builds
each step, and turns the step's sampled tokens into outputs (detokenised, stop-checked) pushed
into each request's stream without ever waiting on a consumer. Aborts and resumes from
consumers run in the trio thread and take effect at once; a request finished while its step
runs keeps its finish (the step's token for it is dropped). However `run` ends (drain, cancel or
crash) every live request is finished with an error and its blocks freed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from functools import partial

import trio

from loom.block_manager import BlockManager
from loom.engine_config import EngineConfig
from loom.engine_stats import EngineStats, ModelInfo
from loom.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from loom.loader import LoadedModel
from loom.model_runner import ModelRunner
from loom.output_processor import OutputProcessor
from loom.prompt import Prompt, PromptChecker, Submission
from loom.request import Request, RequestStatus
from loom.request_output import Logprobs, RequestOutput
from loom.request_stream import RequestStream
from loom.sampler import Sampler, SamplerOutput
from loom.sampling_params import SamplingParams
from loom.scheduler import Scheduler, SchedulerOutput


class Engine:
    def __init__(self, config: EngineConfig, load: Callable[[], LoadedModel]) -> None:
        self.config = config
        self.load = load
        self.streams: dict[str, RequestStream] = {}  # live requests, admitted or not
        self.requests: dict[str, Request] = {}  # live admitted requests
        self.num_admitting = 0
        self.stopped_reason: str | None = "the engine is not started"
        self.admission_send, self.admission_recv = trio.open_memory_channel[Submission](
            config.max_waiting_requests
        )
        self.admission_done = False
        self.wakeup = trio.Event()
        self.limiter = trio.CapacityLimiter(1)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, allocate the KV pool, then serve until drained, cancelled or crashed."""
        loaded = await trio.to_thread.run_sync(self.load)
        self.runner = await trio.to_thread.run_sync(partial(self.make_runner, loaded))
        self.scheduler = Scheduler(
            self.config.scheduler,
            BlockManager(num_blocks=self.runner.num_blocks, block_size=self.config.block_size),
        )
        self.sampler = Sampler(self.runner.vocab_size, self.runner.device)
        self.prompts = PromptChecker.for_model(
            loaded, self.runner, self.scheduler.block_manager, self.config.max_waiting_tokens
        )
        self.outputs = OutputProcessor(loaded.tokenizer)
        self.model_name = loaded.name
        self.stopped_reason = None
        task_status.started()
        step_send, step_recv = trio.open_memory_channel[SchedulerOutput](0)
        result_send, result_recv = trio.open_memory_channel[SamplerOutput](0)
        reason = "the engine stopped"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.admission_task)
                nursery.start_soon(self.scheduling_task, step_send, result_recv)
                nursery.start_soon(self.stepping_task, step_recv, result_send)
        except Exception as exc:
            reason = f"the engine crashed: {exc!r}"
            raise
        finally:
            self.stop(reason)

    def make_runner(self, loaded: LoadedModel) -> ModelRunner:
        config = self.config
        return ModelRunner(
            loaded,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_cache_memory=config.kv_cache_memory,
            kv_cache_memory_fraction=(
                None
                if config.num_blocks or config.kv_cache_memory
                else config.kv_cache_memory_fraction
            ),
        )

    # The request API, called in the trio thread.

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> RequestStream:
        """Queue a request; its outputs arrive in the returned stream. Raises at once when the
        engine is not serving, the id is taken, or the waiting queue is full."""
        if self.stopped_reason is not None:
            raise EngineDeadError(self.stopped_reason)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.streams:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        num_queued = len(self.scheduler.waiting) + self.num_admitting
        if num_queued >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"the waiting queue is full: {num_queued} requests "
                f"(max_waiting_requests={self.config.max_waiting_requests})"
            )
        self.prompts.check_size(prompt, self.config.max_prompt_chars)
        stream = RequestStream(request_id, self.config.output_buffer_size)
        # Called by the consumer, which may be in another thread (the gRPC bridge).
        token = trio.lowlevel.current_trio_token()
        stream.on_drained = partial(token.run_sync_soon, partial(self.resume, request_id))
        self.admission_send.send_nowait(
            Submission(
                request_id=request_id,
                prompt=prompt,
                sampling=sampling or SamplingParams(),
                arrival_time=trio.current_time(),
                deadline=deadline,
                stream=stream,
            )
        )
        self.streams[request_id] = stream
        self.num_admitting += 1
        return stream

    @asynccontextmanager
    async def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> AsyncIterator[AsyncIterator[RequestOutput]]:
        """`async with engine.generate(...) as outputs: async for output in outputs: ...`

        Leaving the block early, by cancellation or an error, aborts the request."""
        stream = self.submit(prompt, sampling, request_id=request_id, deadline=deadline)
        try:
            async with aclosing(stream.outputs()) as outputs:
                yield outputs
        finally:
            self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Finish a request as ABORTED and free its blocks. Safe for unknown or finished ids."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED, error="aborted")
            self.wakeup.set()
        else:
            self.streams.pop(request_id, None)  # still being admitted: the admission task drops it

    def resume(self, request_id: str) -> None:
        """The consumer drained a full buffer: schedule the request again."""
        request = self.requests.get(request_id)
        if request is not None and request.paused:
            request.paused_since = None
            self.wakeup.set()

    def drain(self) -> None:
        """Take no new requests; `run` returns once the admitted ones have finished."""
        if self.stopped_reason is None:
            self.stopped_reason = "the engine is draining"
        self.admission_send.close()

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        return EngineStats(
            num_running=sum(not r.paused for r in scheduler.running),
            num_waiting=len(scheduler.waiting) + self.num_admitting,
            num_paused=sum(r.paused for r in scheduler.requests()),
            num_total_blocks=scheduler.block_manager.num_total_blocks,
            num_free_blocks=scheduler.block_manager.num_free_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_chunked_prefills=scheduler.num_chunked_prefills,
            num_prompt_tokens=self.outputs.num_prompt_tokens,
            num_generated_tokens=self.outputs.num_generated_tokens,
            finished={reason.value: n for reason, n in self.outputs.finished.items()},
        )

    def model_info(self) -> ModelInfo:
        if self.stopped_reason == "the engine is not started":
            raise EngineDeadError("the model is still loading")
        return ModelInfo(
            model=self.model_name,
            max_model_len=self.prompts.max_model_len,
            vocab_size=self.runner.vocab_size,
            dtype=str(self.runner.kv_cache_shape.dtype).removeprefix("torch."),
            device=str(self.runner.device),
            block_size=self.config.block_size,
        )

    # The three tasks.

    async def admission_task(self) -> None:
        async with self.admission_recv:
            async for submission in self.admission_recv:
                try:
                    request = await self.prompts.admit(submission, self.scheduler.waiting)
                except Exception as exc:  # invalid, overloaded, or a tokenizer failure
                    if self.streams.pop(submission.request_id, None) is not None:
                        submission.stream.fail(exc)
                    continue
                finally:
                    self.num_admitting -= 1
                if submission.request_id not in self.streams:
                    continue  # aborted while it was being admitted
                self.requests[request.request_id] = request
                self.outputs.add_request(request)
                self.scheduler.add_request(request)
                self.wakeup.set()
        self.admission_done = True
        self.wakeup.set()

    async def scheduling_task(
        self,
        step_send: trio.MemorySendChannel[SchedulerOutput],
        result_recv: trio.MemoryReceiveChannel[SamplerOutput],
    ) -> None:
        async with step_send, result_recv:
            while True:
                self.wakeup = trio.Event()
                self.expire(trio.current_time())
                output = self.scheduler.schedule(trio.current_time())
                if output is None:
                    if self.admission_done and not self.scheduler.has_unfinished():
                        return
                    with trio.move_on_at(self.scheduler.next_timer(self.config.stall_timeout)):
                        await self.wakeup.wait()
                    continue
                await step_send.send(output)
                sampled = await result_recv.receive()
                self.process(output, sampled, trio.current_time())

    async def stepping_task(
        self,
        step_recv: trio.MemoryReceiveChannel[SchedulerOutput],
        result_send: trio.MemorySendChannel[SamplerOutput],
    ) -> None:
        async with step_recv, result_send:
            async for output in step_recv:
                sampled = await trio.to_thread.run_sync(
                    self.execute, output, limiter=self.limiter, abandon_on_cancel=False
                )
                await result_send.send(sampled)

    def execute(self, output: SchedulerOutput) -> SamplerOutput:
        """In the worker thread: one forward for the whole batch, then batched sampling."""
        logits = self.runner.execute(output.sequences)
        rows = list(output.sample_index)
        if len(rows) < len(output.sequences):  # mid-prompt chunks sample nothing
            logits = logits[rows]
        return self.sampler.sample(logits, [output.requests[i] for i in rows])

    # Turning steps into outputs, in the scheduling task.

    def process(self, output: SchedulerOutput, sampled: SamplerOutput, now: float) -> None:
        for j in self.scheduler.update(output, sampled.token_ids):
            self.emit(output.requests[output.sample_index[j]], sampled.logprobs[j], now)

    def emit(self, request: Request, logprobs: Logprobs | None, now: float) -> None:
        delta, status = self.outputs.new_token(request, logprobs, now)
        if status is not None:
            self.finish(request, status, delta=delta)
        elif self.streams[request.request_id].push(delta):
            request.paused_since = now  # the consumer's buffer is full

    def expire(self, now: float) -> None:
        for request, status in self.scheduler.expired(now, self.config.stall_timeout):
            if status is RequestStatus.FINISHED_DEADLINE:
                where = "while queued" if request.first_scheduled_time is None else "mid-decode"
                error = f"the deadline passed {where}"
            else:
                error = f"the client read nothing for stall_timeout={self.config.stall_timeout} s"
            self.finish(request, status, error=error)

    def finish(
        self,
        request: Request,
        status: RequestStatus,
        *,
        error: str | None = None,
        delta: RequestOutput | None = None,
    ) -> None:
        if not self.scheduler.finish(request, status, error):
            return
        del self.requests[request.request_id]
        final = self.outputs.final(request, trio.current_time(), delta)
        self.streams.pop(request.request_id).push(final)

    def stop(self, reason: str) -> None:
        """End every live request with an error; take no new ones."""
        self.stopped_reason = reason
        self.admission_send.close()
        for request in list(self.requests.values()):
            self.finish(request, RequestStatus.FINISHED_ERROR, error=reason)
        for stream in self.streams.values():  # still in the admission channel: never admitted
            stream.fail(EngineDeadError(reason))
        self.streams.clear()
        self.num_admitting = 0
