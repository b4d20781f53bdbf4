"""The trio engine: its life (loading, serving, draining, stopped) and the request API.

`run` loads the model and its runner in worker threads, builds the `EngineCore` whole
(loom/engine/engine_core.py: scheduler, admission, the stepping loop), and runs it until drained,
cancelled or crashed; however it ends, every live request ends with an error and its blocks are
freed. Before the model has loaded there is no core: every call says why it cannot be served.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from functools import partial
from typing import Protocol

import attrs
import trio

from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from loom.core.kv_events import KvEventLog
from loom.core.prompt import Prompt
from loom.core.request_output import RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.core.tenancy import SHARED, Tenancy
from loom.engine.config import EngineConfig
from loom.engine.engine_core import EngineCore
from loom.engine.metrics import EngineMetrics
from loom.engine.observer import Observer
from loom.engine.request_stream import RequestStream
from loom.engine.stats import EngineStats, ModelInfo
from loom.model.device import release_freed_memory
from loom.model.family import UnsupportedModelError
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner

log = logging.getLogger(__name__)


class RunnerFactory(Protocol):
    """ModelRunner, or a runner like it (the simulated model's, a test's)."""

    def __call__(
        self, loaded: LoadedModel, cache: CacheConfig, *, steps: SchedulerConfig
    ) -> ModelRunner: ...


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
        self.core: EngineCore | None = None  # once the model has loaded
        self.metrics = EngineMetrics()
        self.observer = Observer(self.metrics)  # every event counted, by the engine's core

    @property
    def loaded(self) -> bool:
        return self.core is not None

    @property
    def published_stats(self) -> EngineStats | None:
        """The stats a scrape reads, from any thread (published as the engine steps)."""
        return self.observer.published

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model, allocate the KV pool, then serve until drained, cancelled or crashed."""
        reason = EngineState.STOPPED.value
        try:
            loaded = await trio.to_thread.run_sync(self.load)
            draft = self.config.scheduler.speculative.draft_quantization
            loaded = attrs.evolve(loaded, draft_quantization=draft)
            make = partial(self.make_runner, steps=self.config.scheduler)
            runner = await trio.to_thread.run_sync(make, loaded, self.config.cache)
            self.core = core = EngineCore(self.config, loaded, runner, self.observer)
            self.metrics.opened(loaded.name, lambda: self.published_stats)  # read by scrapes
            del loaded  # the transformers model: the runner keeps what it computes with
            await trio.to_thread.run_sync(release_freed_memory)  # not on the event loop
            if self.state is EngineState.LOADING:
                self.state = EngineState.SERVING
            else:  # drained while it loaded
                core.admission.close()
            self.observer.state_changed()
            task_status.started()
            await core.run()
        except UnsupportedModelError as exc:  # refused at start: the CLI names it, one line
            reason = f"the model is not supported: {exc}"
            raise
        except Exception as exc:
            log.exception("the engine crashed")
            # Clients get the kind of fault only: its message may hold another client's data.
            reason = f"the engine crashed ({type(innermost(exc)).__name__}); see the server log"
            raise
        finally:
            self.stop(reason)

    # The request API, called in the trio thread.

    def submit(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        deadline: float | None = None,
        cache_salt: str = "",
        tenancy: Tenancy = SHARED,
    ) -> RequestStream:
        """Queue a request; its outputs arrive in the returned stream, whose `request_id` is the
        engine's own. Raises at once EngineDeadError when the engine is not serving,
        InvalidRequestError for a prompt too large, EngineOverloadedError when the queue is full;
        later refusals (after tokenising) end the stream with the error."""
        try:
            if self.state is not EngineState.SERVING or self.core is None:
                raise EngineDeadError(self.refusal())
            stream = self.core.admission.submit(
                prompt,
                sampling or SamplingParams(),
                deadline=deadline,
                cache_salt=cache_salt,
                tenancy=tenancy,
                abort=self.abort,
                resume=self.resume,
            )
        except (EngineDeadError, InvalidRequestError, EngineOverloadedError) as exc:
            self.observer.refused(exc, tenancy.tenant)
            raise
        self.observer.state_changed()  # one more waiting
        return stream

    @asynccontextmanager
    async def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        deadline: float | None = None,
        cache_salt: str = "",
        tenancy: Tenancy = SHARED,
    ) -> AsyncIterator[AsyncIterator[RequestOutput]]:
        """`async with engine.generate(...) as outputs: async for output in outputs: ...`

        Leaving the block early, by cancellation or an error, aborts the request."""
        stream = self.submit(
            prompt, sampling, deadline=deadline, cache_salt=cache_salt, tenancy=tenancy
        )
        try:
            async with aclosing(stream.outputs()) as outputs:
                yield outputs
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Finish a request as ABORTED and free its blocks. Safe for unknown or finished ids."""
        if self.core is not None:
            self.core.abort(request_id)

    def resume(self, request_id: str) -> None:
        """The consumer drained a full buffer: schedule the request again."""
        if self.core is not None:
            self.core.resume(request_id)

    def drain(self) -> None:
        """Take no new requests; `run` returns once the admitted ones have finished."""
        if self.state in (EngineState.LOADING, EngineState.SERVING):
            self.state = EngineState.DRAINING
        if self.core is not None:
            self.core.admission.close()
        self.observer.state_changed()

    async def until(self, condition: Callable[[], object]) -> None:
        """Return once `condition()` holds, checked now and after each change of the engine's
        state (a submission, a schedule, a refusal, an end, an abort, serving, draining): how
        tests and tools wait on the engine, on an event rather than a poll. EngineDeadError
        once the engine has stopped with the condition false: nothing will change it."""
        while not condition():
            if self.state is EngineState.STOPPED:
                raise EngineDeadError(self.stop_reason)
            await self.observer.changed.wait()

    def stats(self, tenant: str | None = None) -> EngineStats:
        """The engine's figures; by tenant, every tenant's or (`tenant`) that one's alone."""
        return self.loaded_core().stats(tenant)

    def model_info(self) -> ModelInfo:
        core = self.loaded_core()
        max_model_len = core.admission.prompts.max_model_len
        return ModelInfo.of(core.loaded, core.runner, max_model_len, self.config)

    def kv_events(self) -> KvEventLog:
        """The prefix cache's events (loom/core/kv_events.py), once the model is loaded."""
        return self.loaded_core().scheduler.block_manager.events

    def loaded_core(self) -> EngineCore:
        if self.core is None:
            raise EngineDeadError(self.refusal())
        return self.core

    def refusal(self) -> str:
        return self.stop_reason if self.state is EngineState.STOPPED else self.state.value

    def stop(self, reason: str) -> None:
        """End every live request with an error; take no new ones."""
        self.state, self.stop_reason = EngineState.STOPPED, reason
        if self.core is not None:
            self.core.stop(reason)
        self.observer.state_changed()


def innermost(exc: BaseException) -> BaseException:
    """The first exception inside nested exception groups (a crash comes out of nurseries)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
