"""The grpclib server on its own asyncio loop in a worker thread, supervised by a trio task.

trio owns the process; grpclib needs asyncio. `run` starts the thread, reports the bound port,
and when cancelled asks the loop to close the server and return, then joins the thread: an
exception in the asyncio thread comes back out of `run`. Health (grpc.health.v1) starts
NOT_SERVING and follows `set_serving`; reflection lists every service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

import trio
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.protocol import H2Protocol
from grpclib.reflection.service import ServerReflection
from grpclib.server import Server

from loom.bridge import TrioBridge
from loom.engine import Engine
from loom.servicer import LoomServicer

log = logging.getLogger(__name__)


class ConnectionTrackingServer(Server):
    """grpclib's Server, keeping its connections so that shutdown can close them: grpclib
    cancels their calls but leaves the sockets open, and Python 3.11's asyncio does not close
    them either (they were reported unclosed when the garbage collector found them)."""

    def __init__(self, handlers: Any) -> None:
        super().__init__(handlers)
        self.protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        self.protocols.add(protocol)
        return protocol

    def close_connections(self) -> None:
        for protocol in list(self.protocols):
            if hasattr(protocol, "connection"):  # set once connected
                protocol.connection.close()


class GrpcServer:
    def __init__(self, engine: Engine, *, host: str, port: int, send_timeout: float) -> None:
        self.engine = engine
        self.host = host
        self.port = port
        self.send_timeout = send_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_event: asyncio.Event | None = None
        self.stop_requested = False
        self.servicer: LoomServicer | None = None
        self.health = ServiceStatus()
        self.server: ConnectionTrackingServer | None = None

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
        self.stop_event = asyncio.Event()
        if self.stop_requested:
            return
        self.health.set(False)
        self.servicer = LoomServicer(self.engine, TrioBridge(token, self.loop), self.send_timeout)
        health = Health({self.servicer: [self.health]})
        self.server = ConnectionTrackingServer(ServerReflection.extend([self.servicer, health]))
        await self.server.start(self.host, self.port)
        listener = self.server._server  # grpclib exposes the port only through it
        if not isinstance(listener, asyncio.Server) or not listener.sockets:
            raise RuntimeError(f"the gRPC server did not bind {self.host}:{self.port}")
        token.run_sync_soon(on_bound, listener.sockets[0].getsockname()[1])
        try:
            await self.stop_event.wait()
        finally:
            self.server.close()
            await self.server.wait_closed()
            self.server.close_connections()
            await asyncio.sleep(0)  # the transports close their sockets on the next loop turn

    def in_loop(self, fn: Callable[[], Any]) -> None:
        """Run `fn` in the asyncio thread (a no-op once the loop has gone)."""
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(fn)

    def set_serving(self, serving: bool) -> None:
        self.in_loop(lambda: self.health.set(serving))

    def begin_drain(self) -> None:
        """New calls get UNAVAILABLE and health says NOT_SERVING (probes see it: the port still
        listens until `stop_listening`)."""

        def drain() -> None:
            if self.servicer is not None:
                self.servicer.draining = True
            self.health.set(False)

        self.in_loop(drain)

    def stop_listening(self) -> None:
        """Accept no new connections; open ones carry on."""

        def close() -> None:
            if self.server is not None and self.server._server is not None:
                self.server._server.close()

        self.in_loop(close)

    @property
    def num_connections(self) -> int:
        """Open client connections (asyncio.Server counts them; it has no public API for it)."""
        listener = self.server._server if self.server is not None else None
        return int(getattr(listener, "_active_count", 0))

    @property
    def num_in_flight(self) -> int:
        return self.servicer.num_in_flight if self.servicer is not None else 0
