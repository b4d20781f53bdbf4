"""An in-process Loom server (trio, with its grpclib thread) for tests, on 127.0.0.1 port 0."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from loom.engine.config import EngineConfig
from loom.engine.engine import Engine, RunnerFactory
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner
from loom.server.boundary import BoundaryConfig
from loom.server.config import ServerConfig
from loom.server.openai.config import HttpConfig
from loom.server.supervisor import Supervisor
from loom.server.tenants import TenantConfig
from loom.server.vllm.config import VllmConfig


@asynccontextmanager
async def serving(
    loaded: LoadedModel,
    make_runner: RunnerFactory = ModelRunner,
    *,
    tenants: TenantConfig | None = None,
    boundary: BoundaryConfig | None = None,
    http: HttpConfig | None = None,
    vllm: VllmConfig | None = None,
    **config: Any,
) -> AsyncIterator[tuple[Supervisor, int]]:
    """With `http`, the HTTP API too (its port: `server.http_port`)."""
    engine = Engine(EngineConfig(**config), lambda: loaded, make_runner=make_runner)
    settings = ServerConfig(
        port=0,
        drain_timeout=5,
        tenants=tenants or TenantConfig(),
        boundary=boundary or BoundaryConfig(),
        http=http or HttpConfig(),
        vllm=vllm or VllmConfig(),
    )
    server = Supervisor(engine, settings)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.run)
        try:
            yield server, port
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def loading(
    loaded: LoadedModel,
) -> AsyncIterator[tuple[Supervisor, int, threading.Event]]:
    """A server whose model load waits for the yielded event: itself and its port, bound
    before it serves."""
    release = threading.Event()

    def slow_load() -> LoadedModel:
        release.wait(30)
        return loaded

    server = Supervisor(Engine(EngineConfig(), slow_load), ServerConfig(port=0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run)
        await server.listening.wait()  # bound, while the model still loads
        assert server.port is not None
        try:
            yield server, server.port, release
        finally:
            release.set()
            nursery.cancel_scope.cancel()


async def waited(engine: Engine, condition: Callable[[], object]) -> float:
    """Wait for `condition()` on the engine's own event (`Engine.until`; the test's
    `fail_after` bounds it): the seconds it took."""
    start = time.monotonic()
    await engine.until(condition)
    return time.monotonic() - start


async def until(condition: Callable[[], object], seconds: float = math.inf) -> float:
    """Poll `condition()`, for state that offers no event to wait on from trio (the I/O thread's
    caps and budget, a compiler's queue, what a client has read): the seconds it took (at most
    about `seconds`; without it, the test's `fail_after` bounds the wait)."""
    start = time.monotonic()
    while not condition() and time.monotonic() - start < seconds:  # noqa: ASYNC110
        await trio.sleep(0.01)
    return time.monotonic() - start


def idle(engine: Engine) -> bool:
    """Nothing running, waiting or paused, and every block free."""
    stats = engine.stats()
    return (
        stats.num_running + stats.num_waiting + stats.num_paused == 0
        and stats.num_free_blocks == stats.num_total_blocks
    )


async def closed_mid_answer(server: Supervisor, path: str, body: dict[str, Any]) -> float:
    """POST `body` to the HTTP port on a raw socket, close it once the request runs: the
    seconds until the engine is idle again (every block free)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port or 0))
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
    )
    await waited(server.engine, lambda: server.engine.stats().num_running == 1)
    sock.close()
    return await waited(server.engine, lambda: idle(server.engine))
