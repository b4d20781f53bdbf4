"""An in-process Loom server (trio, with its grpclib thread) for tests, on 127.0.0.1 port 0."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from loom.engine import Engine
from loom.engine_config import EngineConfig
from loom.loader import LoadedModel
from loom.server import LoomServer, ServerConfig


@asynccontextmanager
async def serving(loaded: LoadedModel, **config: Any) -> AsyncIterator[tuple[LoomServer, int]]:
    server = LoomServer(
        Engine(EngineConfig(**config), lambda: loaded), ServerConfig(port=0, drain_timeout=5)
    )
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.run)
        try:
            yield server, port
        finally:
            nursery.cancel_scope.cancel()


async def wait_for_port(server: LoomServer) -> int:
    """The bound port of a server started with `start_soon` (it reports it only once serving)."""
    while True:
        grpc = server.grpc.server
        listener = grpc._server if grpc is not None else None
        if isinstance(listener, asyncio.Server) and listener.sockets:
            return int(listener.sockets[0].getsockname()[1])
        await trio.sleep(0.01)


@asynccontextmanager
async def loading(loaded: LoadedModel) -> AsyncIterator[tuple[int, threading.Event]]:
    """A server whose model load waits for the yielded event: its port, before it serves."""
    release = threading.Event()

    def slow_load() -> LoadedModel:
        release.wait(30)
        return loaded

    server = LoomServer(Engine(EngineConfig(), slow_load), ServerConfig(port=0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        try:
            yield await wait_for_port(server), release
        finally:
            release.set()
            nursery.cancel_scope.cancel()
