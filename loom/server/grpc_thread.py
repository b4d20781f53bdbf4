"""The trio side's handle on the server's asyncio thread, where the gRPC endpoint, the HTTP
front (OpenAI's API, with `http_port` set; loom/server/openai/) and the metrics port live:
`run` starts the thread, builds everything there, reports the bound port,
and when cancelled stops the endpoint and joins the thread; an exception in the asyncio thread
comes back out of `run`. The trio side steers it with `in_loop` and waits on its counts
(`until_zero`).

Health (grpc.health.v1) starts NOT_SERVING and follows `set_serving`; reflection lists every
service.

The asyncio thread runs at the lowest CPU priority (nice 19). On a machine with as many cores
as the model's threads, an op of the step waits for its slowest thread, and a send that takes
a core for a time slice stalls the whole op; at the lowest priority the sends wait for the
model's threads to idle instead. Measured on 2 cores, q4, the standard workload: 143 -> 170
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
from loom.server.boundary.call import Call
from loom.server.boundary.endpoint import Endpoint
from loom.server.boundary.tls import server_context
from loom.server.bridge import Count, TrioBridge
from loom.server.config import ServerConfig
from loom.server.drain import DrainPhase
from loom.server.metrics import MetricsEndpoint, boundary_refusals
from loom.server.openai.api import OpenAIApi
from loom.server.openai.front import HttpFront
from loom.server.servicer import LoomServicer
from loom.server.tenants import Tenant, Tenants
from loom.server.traffic import Traffic

LOWEST_PRIORITY = 19  # nice, for this thread only (Linux: a thread's own priority)


class GrpcThread:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tls = server_context(config.boundary)  # a bad file fails here, at start
        self.http_tls = server_context(config.boundary, alpn=("http/1.1",))
        self.tenants = Tenants(config.tenants)  # and a bad key file
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.stop_requested = False
        self.health = ServiceStatus()
        self.endpoint: Endpoint | None = None
        self.servicer: LoomServicer | None = None
        self.metrics: MetricsEndpoint | None = None  # with `metrics_port` set
        self.http: HttpFront | None = None  # with `http_port` set
        self.http_port: int | None = None

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
        """The asyncio thread's main: build the endpoint in the loop that runs it."""
        self.loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, AttributeError):  # not every platform has it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
        self.stop_event = asyncio.Event()
        if self.stop_requested:
            return
        self.health.set(False)
        self.servicer = servicer = LoomServicer(self.engine, TrioBridge(token, self.loop))
        services = ServerReflection.extend([servicer, Health({servicer: [self.health]})])
        registry = self.engine.metrics.registry
        refused = boundary_refusals(registry)
        self.traffic = Traffic(self.config.boundary)
        self.endpoint = Endpoint(
            services, self.config.boundary, refused, self.identify, self.traffic, self.tls
        )
        try:
            port = await self.endpoint.start(self.config.host, self.config.port)
            if self.config.http.http_port is not None:
                await self.start_http(servicer, refused)
            if self.config.metrics_port is not None:
                self.metrics = MetricsEndpoint(registry)
                await self.metrics.start(self.config.metrics_host, self.config.metrics_port)
            token.run_sync_soon(on_bound, port)
            await self.stop_event.wait()
        finally:
            if self.metrics is not None:
                await self.metrics.close()
            if self.http is not None:
                await self.http.close()
            await self.endpoint.close()

    async def start_http(self, servicer: LoomServicer, refused: Callable[[str], None]) -> None:
        """OpenAI's HTTP API on the same engine, tenants, counts and Abort registry."""
        config = self.config
        api = OpenAIApi(
            self.engine, servicer.bridge, self.tenants, servicer.live, config.http, config.boundary
        )
        self.http = HttpFront(
            api, config.boundary, config.http, self.endpoint, self.traffic, refused, self.http_tls
        )
        assert config.http.http_port is not None
        self.http_port = await self.http.start(config.http.http_host, config.http.http_port)

    def identify(self, call: Call) -> Tenant | None:
        """The call's tenant (loom/server/tenants.py); None for a health probe that needs none."""
        peer = call.peer
        return self.tenants.identify(call.path, call.metadata, peer.addr(), peer.cert())

    @property
    def metrics_port(self) -> int | None:
        return self.metrics.address()[1] if self.metrics is not None else None

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

    def enter(self, phase: DrainPhase) -> bool:
        """The endpoint enters a drain phase (in its thread); False once the loop has gone."""

        def enter() -> None:
            if self.endpoint is not None:
                self.endpoint.enter(phase)
            if self.http is not None:
                self.http.enter(phase)

        return self.in_loop(enter)

    @property
    def num_connections(self) -> int:
        """Open client connections (read across threads: for a log line, not for a decision)."""
        return self.endpoint.num_connections.value if self.endpoint is not None else 0

    async def until_zero(self, name: str) -> None:
        """In trio: return once the endpoint's count `name` is zero (or the loop, or the
        endpoint, is gone)."""
        done = trio.Event()
        notify = partial(trio.lowlevel.current_trio_token().run_sync_soon, done.set)

        def count() -> Count | None:
            return getattr(self.endpoint, name) if self.endpoint is not None else None

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
