"""Calls from the gRPC server's asyncio thread into the trio thread, and wake-ups back.

grpclib runs only on asyncio, so it has its own loop in its own thread; the engine lives in
trio's. Each direction has one primitive: `call` runs a sync function in the trio thread and
awaits its result (or exception) on asyncio; `waker` makes a callback that the trio thread may
call as often as it likes and that sets an asyncio.Event at most once per loop iteration. A
`Count` kept in the asyncio thread (streams in flight, open connections) tells the trio thread
when it falls to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from loom.core.errors import EngineDeadError

T = TypeVar("T")


class TrioBridge:
    def __init__(
        self, trio_token: trio.lowlevel.TrioToken, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.trio_token = trio_token
        self.loop = loop

    async def call(
        self, fn: Callable[..., T], *args: Any, orphan: Callable[[T], object] | None = None
    ) -> T:
        """Run `fn(*args)` in the trio thread; its result or exception comes back here. Once
        asked, the call happens even if the caller is cancelled meanwhile: then `orphan(result)`
        undoes what it made (in the asyncio thread, or the trio thread if this loop is gone)."""
        future: asyncio.Future[T] = self.loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)  # type: ignore[arg-type]
            elif error is None and orphan is not None:  # the caller was cancelled meanwhile
                orphan(result)  # type: ignore[arg-type]

        def run() -> None:
            result: T | None = None
            error: Exception | None = None
            try:
                result = fn(*args)
            except Exception as exc:
                error = exc
            try:
                self.loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop has closed: its handlers are gone
                if error is None and orphan is not None:
                    orphan(result)  # type: ignore[arg-type]

        try:
            self.trio_token.run_sync_soon(run)
        except trio.RunFinishedError:
            raise EngineDeadError("the engine has stopped") from None
        try:
            return await future
        except asyncio.CancelledError:  # the result may have come in just before
            settled = future.done() and not future.cancelled() and future.exception() is None
            if orphan is not None and settled:
                orphan(future.result())
            raise

    def soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run `fn(*args)` in the trio thread, not waiting for it (nothing, once it has ended)."""
        with contextlib.suppress(trio.RunFinishedError):
            self.trio_token.run_sync_soon(fn, *args)

    def waker(self, event: asyncio.Event) -> Callable[[], None]:
        """A thread-safe, coalescing `event.set` for the trio thread to call."""
        pending = False

        def fire() -> None:
            nonlocal pending
            pending = False
            event.set()

        def wake() -> None:
            nonlocal pending
            if not pending:
                pending = True
                # RuntimeError: the loop has closed, so nobody is waiting any more.
                with contextlib.suppress(RuntimeError):
                    self.loop.call_soon_threadsafe(fire)

        return wake


class Count:
    """A number kept in the asyncio thread, with callbacks for when it is zero: how the trio
    thread waits on it without polling (its callback schedules a trio `Event.set`)."""

    def __init__(self) -> None:
        self.value = 0
        self.on_zero: list[Callable[[], object]] = []

    def add(self, delta: int) -> None:
        self.value += delta
        if self.value == 0:
            callbacks, self.on_zero = self.on_zero, []
            for callback in callbacks:
                callback()

    def when_zero(self, callback: Callable[[], object]) -> None:
        if self.value == 0:
            callback()
        else:
            self.on_zero.append(callback)

    def forget(self, callback: Callable[[], object]) -> None:
        """Drop a callback whose waiter gave up."""
        if callback in self.on_zero:
            self.on_zero.remove(callback)
