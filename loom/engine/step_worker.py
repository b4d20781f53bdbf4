"""The model's thread: it launches the steps the stepping loop hands it, in order, one after
another, with nothing between two launches but a queue's `get`.

A step handed over while the one before is still launching (on a CPU: computing; on a GPU:
queueing its kernels) starts the moment that one is done, without a round trip through the
event loop: so with overlapped steps (loom/engine/engine_core.py) the device, or on a CPU the
worker, never waits for the trio thread, which meanwhile applies and publishes the step before.
Each `Flight` says when it is launched (`launched`, set in the trio thread) and with what: the
runner's `Launched`, or the error its launch raised; after an error no later step is launched
(its pending tokens would be that step's), each failing with that error.

The thread is started and stopped by `step_worker`: on the way out the steps not begun are
dropped, and the thread is waited for, whatever ended the stepping loop, so that no launch
outlives the engine's run (the runner's pool and weights are freed after it).
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import attrs
import trio

from loom.core.step import SchedulerOutput
from loom.model.grammar import Drafted
from loom.model.launched import Launched
from loom.model.sampler import Masks

Launch = Callable[[SchedulerOutput, Masks | None], Launched]


@attrs.define(eq=False)
class Flight:
    """A step scheduled and handed to the worker, and not yet applied."""

    output: SchedulerOutput
    matchers: list[Drafted]  # its constrained rows', in the sampler's order
    masks: Masks | None  # their masks, once filled (on a thread of their own)
    start: float = 0.0  # time.perf_counter() when its launch began
    launched: trio.Event = attrs.field(factory=trio.Event)
    result: Launched | None = None
    error: BaseException | None = None

    def launched_result(self) -> Launched:
        """Once `launched`: what the launch gave, or its error raised here."""
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise RuntimeError("a step was launched without a result")
        return self.result


class StepWorker:
    def __init__(self, launch: Launch, token: trio.lowlevel.TrioToken) -> None:
        self.launch = launch
        self.token = token
        self.queue: queue.SimpleQueue[Flight | None] = queue.SimpleQueue()

    def submit(self, flight: Flight) -> None:
        self.queue.put(flight)

    def work(self) -> None:
        failed: BaseException | None = None
        while (flight := self.queue.get()) is not None:
            flight.start = time.perf_counter()
            if failed is not None:
                flight.error = failed
            else:
                try:
                    flight.result = self.launch(flight.output, flight.masks)
                except BaseException as error:  # raised in the trio thread, by `land`
                    flight.error = failed = error
            self.token.run_sync_soon(flight.launched.set)

    def stop(self) -> None:
        """No step handed over and not begun is launched; the thread ends after the one it
        is launching, if any."""
        with contextlib.suppress(queue.Empty):
            while True:
                self.queue.get_nowait()
        self.queue.put(None)


@asynccontextmanager
async def step_worker(launch: Launch) -> AsyncIterator[StepWorker]:
    """The worker, its thread running while the block runs (a thread of trio's: a test's
    runner calls back with `trio.from_thread`); stopped after it, and waited for, whatever
    ended the block."""
    worker = StepWorker(launch, trio.lowlevel.current_trio_token())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(trio.to_thread.run_sync, worker.work, abandon_on_cancel=False))
        try:
            yield worker
        finally:
            worker.stop()
