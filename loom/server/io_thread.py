"""The server's I/O thread: one asyncio loop, in its own thread, that runs the gRPC endpoint
(loom/server/grpc/), the HTTP front (OpenAI's API, with `http_port` set;
loom/server/openai/) and the metrics port. grpclib and the HTTP/1.1 and HTTP/2 layers run on
asyncio; the engine runs in trio's thread.

`IoThread.run` starts the thread, which builds everything in the loop that runs it, binds the
ports, and hands the trio side one frozen handle (`Io`) through `task_status.started()`: the
ports, health, and the traffic ledger (loom/server/traffic.py) to enter drain phases on and
wait on counts of. When `run` is cancelled the fronts close and the thread is joined; an
exception in the thread comes back out of `run`.

Health (grpc.health.v1) starts NOT_SERVING and follows `Io.set_serving`; reflection lists
every service.

The thread runs at the lowest CPU priority (nice 19). On a machine with as many cores as the
model's threads, an op of the step waits for its slowest thread, and a send that takes a core
for a time slice stalls the whole op; at the lowest priority the sends wait for the model's
threads to idle instead. Measured on 2 cores, q4, the standard workload: 143 -> 170 tok/s at
8 streams, 178 -> 209 at 64 (BENCHMARKS.md, run G).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import trio
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.reflection.service import ServerReflection

from loom.engine.engine import Engine
from loom.server.bridge import Count, TrioBridge
from loom.server.config import ServerConfig
from loom.server.grpc.call import Call
from loom.server.grpc.endpoint import Endpoint
from loom.server.grpc.servicer import LoomServicer
from loom.server.metrics import MetricsEndpoint, boundary_refusals
from loom.server.openai.api import OpenAIApi
from loom.server.openai.front import HttpFront
from loom.server.tenants import Tenant, Tenants
from loom.server.tls import server_context
from loom.server.traffic import DrainPhase, Traffic
from loom.server.vllm.servicer import VllmServicer

LOWEST_PRIORITY = 19  # nice, for this thread only (Linux: a thread's own priority)


@attrs.frozen
class Io:
    """The trio side's handle on the running I/O thread. Its fields are the thread's; the trio
    side touches them only through these methods, which run their work in the loop."""

    loop: asyncio.AbstractEventLoop
    traffic: Traffic
    health: ServiceStatus
    port: int
    http_port: int | None  # with `http_port` set
    metrics_address: tuple[str, int] | None  # with `metrics_port` set

    def in_loop(self, fn: Callable[[], Any]) -> bool:
        """Run `fn` in the I/O thread. False (and a no-op) once the loop has gone."""
        if self.loop.is_closed():
            return False
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # closed meanwhile
            return False
        return True

    def set_serving(self, serving: bool) -> None:
        self.in_loop(partial(self.health.set, serving))

    def enter(self, phase: DrainPhase) -> bool:
        """Every front enters a drain phase; False once the loop has gone."""
        return self.in_loop(partial(self.traffic.enter, phase))

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_address[1] if self.metrics_address is not None else None

    @property
    def num_connections(self) -> int:
        """Open client connections (read across threads: for a log line, not for a decision)."""
        return self.traffic.connections.value

    async def until_zero(self, count: Count) -> None:
        """In trio: return once `count`, one of the ledger's, is zero (or the loop is gone)."""
        done = trio.Event()
        notify = partial(trio.lowlevel.current_trio_token().run_sync_soon, done.set)
        if self.in_loop(partial(count.when_zero, notify)):
            try:
                await done.wait()
            finally:
                self.in_loop(partial(count.forget, notify))  # a no-op once notified


class IoThread:
    """What the thread is built from; a bad TLS or key file fails here, at start."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tls = server_context(config.boundary)
        self.http_tls = server_context(config.boundary, alpn=("http/1.1",))
        self.tenants = Tenants(config.tenants)

    async def run(self, *, task_status: trio.TaskStatus[Io] = trio.TASK_STATUS_IGNORED) -> None:
        token = trio.lowlevel.current_trio_token()
        stop = Stop()
        handed = trio.Event()
        ios: list[Io] = []

        def hand(io: Io) -> None:
            ios.append(io)
            handed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.host_thread, token, hand, stop)
            try:
                await handed.wait()
                task_status.started(ios[0])
                await trio.sleep_forever()
            finally:
                stop.set()

    async def host_thread(
        self, token: trio.lowlevel.TrioToken, hand: Callable[[Io], None], stop: Stop
    ) -> None:
        serve = self.serve(token, hand, stop)
        await trio.to_thread.run_sync(asyncio.run, serve, abandon_on_cancel=False)

    async def serve(
        self, token: trio.lowlevel.TrioToken, hand: Callable[[Io], None], stop: Stop
    ) -> None:
        """The thread's main: everything made in the loop that runs it, then the handle."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, AttributeError):  # not every platform has it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        config, registry = self.config, self.engine.metrics.registry
        traffic, health, refused = (
            Traffic(config.boundary),
            ServiceStatus(),
            boundary_refusals(registry),
        )
        health.set(False)
        servicer = LoomServicer(self.engine, TrioBridge(token, loop))
        services = self.services(servicer, health, traffic)
        endpoint = Endpoint(services, config.boundary, refused, self.identify, traffic, self.tls)
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(traffic.close)
            if stop.requested:  # cancelled before the loop began: bind nothing
                return
            port = await endpoint.start(config.host, config.port)
            http_port = None
            if config.http.http_port is not None:
                api = OpenAIApi(
                    self.engine,
                    servicer.bridge,
                    self.tenants,
                    servicer.live,
                    config.http,
                    config.boundary,
                )
                http = HttpFront(api, config.boundary, config.http, traffic, refused, self.http_tls)
                http_port = await http.start(config.http.http_host, config.http.http_port)
            metrics_address = None
            if config.metrics_port is not None:
                metrics = MetricsEndpoint(registry)
                stack.push_async_callback(metrics.close)
                await metrics.start(config.metrics_host, config.metrics_port)
                metrics_address = metrics.address()
            token.run_sync_soon(hand, Io(loop, traffic, health, port, http_port, metrics_address))
            await stop.wait()

    def services(
        self, servicer: LoomServicer, health: ServiceStatus, traffic: Traffic
    ) -> list[Any]:
        """What the gRPC port serves: loom.v1, vllm.grpc.engine (on the same bridge and the
        same labels' requests, for Abort; told of the drain), health and reflection."""
        http = self.config.http
        vllm = VllmServicer(
            self.engine,
            servicer.bridge,
            servicer.live,
            health,
            served_model_name=http.served_model_name,
            max_choices=http.max_choices,
            config=self.config.vllm,
        )
        traffic.fronts.append(vllm)
        checks: dict[Any, list[ServiceStatus]] = {servicer: [health], vllm: [health]}
        return list(ServerReflection.extend([servicer, vllm, Health(checks)]))

    def identify(self, call: Call) -> Tenant | None:
        """The call's tenant (loom/server/tenants.py); None for a health probe that needs none."""
        peer = call.peer
        return self.tenants.identify(call.path, call.metadata, peer.addr(), peer.cert())


class Stop:
    """The trio side's word to stop, which may come before the loop exists or after."""

    def __init__(self) -> None:
        self.requested = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None

    def set(self) -> None:
        """In trio. The flag first, the loop read after: the loop's side does the reverse."""
        self.requested = True
        loop, event = self.loop, self.event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to stop
                loop.call_soon_threadsafe(event.set)

    async def wait(self) -> None:
        """In the I/O thread."""
        self.event = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        if not self.requested:
            await self.event.wait()
