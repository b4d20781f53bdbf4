"""The serving process's trio supervisor: the gRPC thread, the engine and the signal watcher
under one nursery.

    trio.run ── root nursery ─┬─ IoThread.run    (asyncio thread: the gRPC endpoint, health,
                              │                   reflection, the HTTP API, the metrics port)
                              ├─ run_engine      (Engine.run: admission task, stepping loop)
                              └─ watch_signals   (SIGTERM/SIGINT → Drain.run; a second → exit now)

The port is bound first, with health NOT_SERVING while the model loads. SIGTERM drains
(loom/server/drain.py: announce, refuse, let the engine finish, close), all within
`drain_timeout` of the signal; then everything closes and the process exits 0. An engine crash
fails every live stream with UNAVAILABLE and the process exits non-zero.
"""

from __future__ import annotations

import logging
import signal

import trio

from loom.engine.engine import Engine, EngineState
from loom.server.config import ServerConfig
from loom.server.drain import Drain
from loom.server.io_thread import Io, IoThread

log = logging.getLogger(__name__)
STOP_WAIT = 5.0  # seconds the handlers get to send their last status when the engine stops


class Supervisor:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.io_thread = IoThread(engine, config)  # a bad TLS or key file fails here
        self.io: Io | None = None  # once the ports are bound (the model may still be loading)
        self.drainer: Drain | None = None  # with `io`
        self.engine_scope = trio.CancelScope()
        self.listening = trio.Event()  # `io` is set
        self.engine_done = trio.Event()
        self.draining = False
        self.exit_code = 0

    @property
    def port(self) -> int | None:
        return self.io.port if self.io is not None else None

    @property
    def metrics_port(self) -> int | None:
        return self.io.metrics_port if self.io is not None else None

    @property
    def http_port(self) -> int | None:
        """The HTTP API's port (OpenAI's), with `http_port` set."""
        return self.io.http_port if self.io is not None else None

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.io = io = await nursery.start(self.io_thread.run)
            self.drainer = drainer = Drain(io, self.engine.drain, self.config.drain_timeout)
            self.listening.set()
            log.info("listening on %s:%d; loading the model", self.config.host, io.port)
            nursery.start_soon(self.watch_signals, nursery)
            await nursery.start(self.run_engine, io)
            log.info("serving on %s:%d", self.config.host, io.port)
            if io.http_port is not None:
                log.info("HTTP API on http://%s:%d/v1", self.config.http.http_host, io.http_port)
            task_status.started(io.port)
            await self.engine_done.wait()
            if self.draining:
                await drainer.done.wait()
            else:
                with trio.move_on_after(STOP_WAIT):
                    await io.until_zero(io.traffic.in_flight)
            nursery.cancel_scope.cancel()

    async def run_engine(
        self, io: Io, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with self.engine_scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.engine.run)
                    if self.engine.state is EngineState.SERVING and not self.draining:
                        io.set_serving(True)  # not drained while it loaded
                    task_status.started()
        except Exception:
            io.set_serving(False)
            # Let the handlers send UNAVAILABLE before the port closes.
            with trio.CancelScope(shield=True), trio.move_on_after(STOP_WAIT):
                await io.until_zero(io.traffic.in_flight)
            raise
        finally:
            io.set_serving(False)
            self.engine_done.set()

    async def drain(self) -> None:
        """What SIGTERM starts (loom/server/drain.py); `run` returns once it is done."""
        assert self.drainer is not None, "the ports are bound before any drain"
        self.draining = True
        await self.drainer.run(self.engine_done, self.engine_scope)

    async def watch_signals(self, nursery: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self.draining:
                    log.info("%s: draining (at most %.0f s)", name, self.config.drain_timeout)
                    self.draining = True  # at once: a second signal exits
                    nursery.start_soon(self.drain)
                else:
                    log.warning("%s again: exiting now", name)
                    self.exit_code = 1
                    nursery.cancel_scope.cancel()
                    return
