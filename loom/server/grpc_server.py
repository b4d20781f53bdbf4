"""The grpclib server on its own asyncio loop in a worker thread, supervised by a trio task.

trio owns the process; grpclib needs asyncio. `run` starts the thread, reports the bound port,
and when cancelled asks the loop to close the server and return, then joins the thread: an
exception in the asyncio thread comes back out of `run`. Health (grpc.health.v1) starts
NOT_SERVING and follows `set_serving`; reflection lists every service. The trio side steers the
loop with `in_loop` and waits on its counts (streams in flight, open connections) by events.

The asyncio thread runs at the lowest CPU priority (nice 19). On a machine with as many cores
as the model's threads, an op of the step waits for its slowest thread, and a gRPC send that
takes a core for a time slice stalls the whole op; at the lowest priority the sends wait for
the model's threads to idle instead. Measured on 2 cores, q4, the standard workload: 143 -> 170
tok/s at 8 streams, 178 -> 209 at 64 (BENCHMARKS.md, run G).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.reflection.service import ServerReflection

from loom.engine.engine import Engine
from loom.server.bridge import Count, TrioBridge
from loom.server.config import ServerConfig
from loom.server.grpclib_server import GrpclibServer
from loom.server.servicer import LoomServicer

LOWEST_PRIORITY = 19  # nice, for this thread only (Linux: a thread's own priority)


class GrpcServer:
    def __init__(self, engine: Engine, config: ServerConfig, *, send_timeout: float) -> None:
        self.engine = engine
        self.config = config
        self.send_timeout = send_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.stop_requested = False
        self.servicer: LoomServicer | None = None
        self.health = ServiceStatus()
        self.server: GrpclibServer | None = None

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        token = trio.lowlevel.current_trio_token()
        bound = trio.Event()
        ports: list[int] = []

        def on_bound(port: int) -> None:
            ports.append(port)
            bound.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.host_thread, token, on_bound)
            nursery.start_soon(self.stop_when_cancelled)
            await bound.wait()
            task_status.started(ports[0])

    async def host_thread(
        self, token: trio.lowlevel.TrioToken, on_bound: Callable[[int], None]
    ) -> None:
        await trio.to_thread.run_sync(
            asyncio.run, self.serve(token, on_bound), abandon_on_cancel=False
        )

    async def stop_when_cancelled(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.stop_requested = True
            self.in_loop(lambda: self.stop_event.set() if self.stop_event else None)

    async def serve(self, token: trio.lowlevel.TrioToken, on_bound: Callable[[int], None]) -> None:
        """The asyncio thread's main: build the server in the loop that runs it."""
        self.loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, AttributeError):  # not every platform has it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        self.stop_event = asyncio.Event()
        if self.stop_requested:
            return
        self.health.set(False)
        self.servicer = LoomServicer(
            self.engine, TrioBridge(token, self.loop), self.config, send_timeout=self.send_timeout
        )
        health = Health({self.servicer: [self.health]})
        self.server = GrpclibServer(
            ServerReflection.extend([self.servicer, health]),
            max_streams_per_connection=self.config.max_streams_per_connection,
            max_request_bytes=self.config.max_request_bytes,
        )
        await self.server.start(self.config.host, self.config.port)
        token.run_sync_soon(on_bound, self.server.port)
        try:
            await self.stop_event.wait()
        finally:
            self.server.close()
            self.server.close_connections()
            await self.server.wait_closed()
            await asyncio.sleep(0)  # the transports close their sockets on the next loop turn

    def in_loop(self, fn: Callable[[], Any]) -> bool:
        """Run `fn` in the asyncio thread. False (and a no-op) once the loop has gone."""
        if self.loop is None or self.loop.is_closed():
            return False
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # closed meanwhile
            return False
        return True

    def set_serving(self, serving: bool) -> None:
        self.in_loop(lambda: self.health.set(serving))

    async def announce_drain(self, deadline: float) -> None:
        """Health says NOT_SERVING (on the connections still open), the port stops listening
        at once (a load balancer's next connection goes to another replica), and connections
        are told to go away: idle ones now, a proxy's after its last stream
        (loom/server/drain.py). Calls still arriving are answered: their clients sent them
        before they heard. Returns once every connection told has shown it heard (its calls
        sent before have arrived), or at `deadline`."""

        def announce() -> None:
            self.health.set(False)
            if self.server is not None:
                self.server.announce_drain()

        await self.run_then_wait(
            announce, lambda: self.server.unheard if self.server else None, deadline
        )

    async def refuse_new_calls(self, deadline: float) -> None:
        """Calls on streams opened from now on get UNAVAILABLE; idle connections get a GOAWAY
        and are closed. Returns once every call admitted before has reached the engine (or
        ended), or at `deadline`."""
        await self.run_then_wait(
            lambda: self.server.refuse_new_calls() if self.server else None,
            lambda: self.server.arriving if self.server else None,
            deadline,
        )

    async def run_then_wait(
        self, fn: Callable[[], Any], count: Callable[[], Count | None], deadline: float
    ) -> None:
        """Run `fn` in the asyncio thread, then wait until `count` is zero (or `deadline`)."""
        if self.in_loop(fn):
            with trio.move_on_at(deadline):
                await self.until_zero(count)

    def stop_listening(self) -> None:
        """Accept no new connections; open ones carry on."""
        self.in_loop(lambda: self.server.stop_listening() if self.server else None)

    async def streams_done(self) -> None:
        """Wait until no Generate handler is left (they have flushed their last messages)."""
        await self.until_zero(lambda: self.servicer.num_in_flight if self.servicer else None)

    @property
    def num_connections(self) -> int:
        """Open client connections (read across threads: for a log line, not for a decision)."""
        return self.server.num_connections.value if self.server is not None else 0

    async def connections_closed(self) -> None:
        """Wait until the clients have closed their connections, having read what was sent."""
        await self.until_zero(lambda: self.server.num_connections if self.server else None)

    async def until_zero(self, count: Callable[[], Count | None]) -> None:
        """In trio: return once a count kept in the asyncio thread is zero (or the loop, or the
        count, is gone)."""
        done = trio.Event()
        notify = partial(trio.lowlevel.current_trio_token().run_sync_soon, done.set)

        def register() -> None:
            counter = count()
            if counter is None:
                notify()
            else:
                counter.when_zero(notify)

        def forget() -> None:
            counter = count()
            if counter is not None:
                counter.forget(notify)

        if self.in_loop(register):
            try:
                await done.wait()
            finally:
                self.in_loop(forget)  # a no-op once notified; else a timeout gave up waiting
