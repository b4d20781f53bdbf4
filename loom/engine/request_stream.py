"""One request's outputs on their way from the engine to a consumer, through a bounded buffer.

The engine side never waits: `push` appends and wakes the consumer (a trio task, or the gRPC
bridge's asyncio loop in another thread: hence the lock). When the buffer holds `capacity`
outputs the engine pauses the request; the consumer's `take` empties the buffer and, if the
request was paused, calls `on_drained` so the engine resumes it: hysteresis of a whole buffer.
Errors found before the request runs (invalid, overloaded) end the stream as an exception. A
consumer that stops early calls `abort`: the engine aborts this very request, if it still runs.
Both calls are safe from any thread: the engine's callbacks are scheduled in the trio thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable

import trio

from loom.core.request_output import FinishReason, RequestOutput


def nothing() -> None:
    pass


def in_trio(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn` as a callable for any thread: it runs in the current trio run's thread, at once when
    called from that thread, else soon (and not at all once the run has finished)."""
    token = trio.lowlevel.current_trio_token()

    def call() -> None:
        if in_run_of(token):
            fn()
            return
        with contextlib.suppress(trio.RunFinishedError):  # the engine is gone, and its requests
            token.run_sync_soon(fn)

    return call


def in_run_of(token: trio.lowlevel.TrioToken) -> bool:
    try:
        return trio.lowlevel.current_trio_token() is token
    except RuntimeError:  # not in any trio run's thread
        return False


class RequestStream:
    def __init__(
        self,
        request_id: str,
        capacity: int,
        *,
        on_drained: Callable[[], None] = nothing,
        on_abort: Callable[[], None] = nothing,
    ) -> None:
        self.request_id = request_id
        self.capacity = capacity
        self.buffer: deque[RequestOutput] = deque()
        self.error: BaseException | None = None
        self.closed = False  # the final output or an error was pushed
        self.finish_reason: FinishReason | None = None  # the final output's, once pushed
        self.paused = False
        self.wake: Callable[[], None] = nothing  # set by the consumer
        self.on_drained = on_drained
        self.on_abort = on_abort
        self.lock = threading.Lock()

    def push(self, output: RequestOutput) -> bool:
        """Engine side: append without waiting. True when the buffer is now full."""
        with self.lock:
            self.buffer.append(output)
            self.closed, self.finish_reason = output.finished, output.finish_reason
            full = len(self.buffer) >= self.capacity and not self.closed
            self.paused = self.paused or full
        self.wake()
        return full

    @property
    def room(self) -> int:
        """How many outputs more fill the buffer (0: full)."""
        with self.lock:
            return max(self.capacity - len(self.buffer), 0)

    def abort(self) -> None:
        """Consumer side: done reading. The engine aborts the request unless it has finished."""
        self.on_abort()

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self.error, self.closed = error, True
        self.wake()

    def take(self) -> list[RequestOutput]:
        """Consumer side: everything buffered; raises the stream's error once it is drained."""
        with self.lock:
            outputs = list(self.buffer)
            self.buffer.clear()
            error = self.error if not outputs else None
            resume, self.paused = self.paused, False
        if resume:
            self.on_drained()
        if error is not None:
            raise error
        return outputs

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        """Consumer side, for trio code: each output until the final one."""
        event = trio.Event()
        self.wake = event.set
        while True:
            batch = self.take()
            for output in batch:
                yield output
                if output.finished:
                    return
            if not batch:
                await event.wait()
                event = trio.Event()
                self.wake = event.set
