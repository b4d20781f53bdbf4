"""The serving process: the gRPC server, the engine and the signal watcher under one nursery.

    trio.run ── root nursery ─┬─ GrpcServer.run   (asyncio thread: grpclib, health, reflection)
                              ├─ run_engine       (Engine.run: admission task, stepping loop)
                              └─ watch_signals    (SIGTERM/SIGINT → drain; a second → exit now)

The port is bound first, with health NOT_SERVING while the model loads. Drain: health turns
NOT_SERVING and the port stops listening at once (a load balancer's next connection goes
elsewhere), idle connections are told to go away, and a proxy's busy ones after their last
stream (loom/server/drain.py); once the idle ones have shown they heard (and `DRAIN_GRACE`
has passed) new calls get UNAVAILABLE and idle connections are closed, the engine finishes
what it admitted (cut short after `drain_timeout`: the rest end UNAVAILABLE), the handlers
flush their last messages, and the clients close their connections (a client that has not yet
read what was sent to it would lose it if the connection dropped), all within `drain_timeout`
of the signal; then everything closes and the process exits 0. An engine crash fails every
live stream with UNAVAILABLE and the process exits non-zero.
"""

from __future__ import annotations

import contextlib
import logging
import signal

import trio

from loom.engine.engine import Engine, EngineState
from loom.server.config import ServerConfig
from loom.server.grpc_server import GrpcServer
from loom.server.metrics import metrics_served

log = logging.getLogger(__name__)
# From the signal to refusing new calls: the port is closed and idle connections told to go
# away at once, each with a PING; a call a client (a proxy) sent before it heard has arrived
# by the PING's answer, and is served (RFC 9113 §6.8 asks for at least a round trip). New
# calls are refused once every peer told has answered (or closed), at most `HEARD_WAIT` after
# the signal (a peer that answers no PING), and no sooner than `DRAIN_GRACE` after it. The
# engine stops taking requests once the Generate calls admitted before have reached it, at
# most `HEARD_WAIT` later (a request message slow to come is then refused).
DRAIN_GRACE = 0.25
HEARD_WAIT = 5.0


class LoomServer:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.grpc = GrpcServer(engine, config, send_timeout=engine.config.stall_timeout)
        self.engine_scope = trio.CancelScope()
        self.listening = trio.Event()  # `port` is bound (the model may still be loading)
        self.port: int | None = None
        self.metrics_port: int | None = None  # bound, with `metrics_port` set
        self.engine_done = trio.Event()
        self.draining = False
        self.drain_deadline: float | None = None
        self.exit_code = 0

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        with contextlib.ExitStack() as stack:
            if self.config.metrics_port is not None:
                self.metrics_port = stack.enter_context(
                    metrics_served(self.engine, self.config.host, self.config.metrics_port)
                )
            await self.serve(task_status)

    async def serve(self, task_status: trio.TaskStatus[int]) -> None:
        async with trio.open_nursery() as nursery:
            self.port = port = await nursery.start(self.grpc.run)
            self.listening.set()
            log.info("listening on %s:%d; loading the model", self.config.host, port)
            nursery.start_soon(self.watch_signals, nursery)
            await nursery.start(self.run_engine)
            log.info("serving on %s:%d", self.config.host, port)
            task_status.started(port)
            await self.engine_done.wait()
            with trio.move_on_at(self.drain_deadline or trio.current_time() + 5.0):
                await self.grpc.streams_done()
                if self.draining:
                    self.grpc.stop_listening()
                    if self.grpc.num_connections:
                        log.info("waiting for %d connections to close", self.grpc.num_connections)
                    await self.grpc.connections_closed()
            nursery.cancel_scope.cancel()

    async def run_engine(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with self.engine_scope:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.engine.run)
                    if self.engine.state is EngineState.SERVING and not self.draining:
                        self.grpc.set_serving(True)  # not drained while it loaded
                    task_status.started()
        except Exception:
            self.grpc.set_serving(False)
            # Let the handlers send UNAVAILABLE before the port closes.
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                await self.grpc.streams_done()
            raise
        finally:
            self.grpc.set_serving(False)
            self.engine_done.set()

    async def watch_signals(self, nursery: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if not self.draining:
                    log.info(
                        "%s: draining (at most %.0f s)",
                        signal.Signals(signum).name,
                        self.config.drain_timeout,
                    )
                    self.draining = True  # at once: a second signal exits
                    nursery.start_soon(self.drain)
                else:
                    log.warning("%s again: exiting now", signal.Signals(signum).name)
                    self.exit_code = 1
                    nursery.cancel_scope.cancel()
                    return

    async def drain(self) -> None:
        """What SIGTERM starts: take no new work, let in-flight streams end (at most
        `drain_timeout`), then let `run` return."""
        self.draining = True
        start = trio.current_time()
        self.drain_deadline = start + self.config.drain_timeout
        # Calls sent before their clients heard are still served (not past the deadline).
        await self.grpc.announce_drain(min(start + HEARD_WAIT, self.drain_deadline))
        await trio.sleep_until(min(start + DRAIN_GRACE, self.drain_deadline))
        await self.grpc.refuse_new_calls(min(trio.current_time() + HEARD_WAIT, self.drain_deadline))
        self.engine.drain()
        with trio.move_on_at(self.drain_deadline):
            await self.engine_done.wait()
            return
        log.warning("drain timeout: ending the requests still running")
        self.engine_scope.cancel()
