"""The per-token cost of each candidate HTTP server's SSE path, measured as Loom's HTTP front
chose its library (docs/apis.md, "The OpenAI HTTP API"; BENCHMARKS.md, run V).

Each candidate serves one route that streams EVENTS chunk events (`data: {json}`, as an OpenAI
chat chunk), one write per event with a turn of the event loop between, like a relay woken per
token. Client processes read each stream as fast as they can over raw sockets; the figure is
the server process's CPU time (user + system, from /proc) per event, at 1 and 8 streams.

    python examples/sse_candidates.py            # every candidate that is installed

Run it alone on the machine: the clients share its cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

EVENTS = 20_000
CHUNK = {
    "id": "chatcmpl-0123456789abcdef",
    "object": "chat.completion.chunk",
    "created": 1764600000,
    "model": "SmolLM2-135M-Instruct",
    "choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": None}],
}


def event() -> bytes:
    return b"data: " + json.dumps(CHUNK).encode() + b"\n\n"


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(EVENTS):
            await response.write(event())
            await asyncio.sleep(0)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_get("/", stream)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handler_cancellation=True)


def serve_loom(port: int) -> None:
    """Loom's own HTTP/1.1 connection (loom/server/openai/connection.py, on h11), as the HTTP
    front runs it, with every limit at its default."""
    from loom.server.boundary import BoundaryConfig
    from loom.server.caps import ConnectionCaps
    from loom.server.openai.connection import HttpConnection
    from loom.server.openai.message import HttpRequest, Response
    from loom.server.openai.origin_policy import OriginPolicy

    config = BoundaryConfig()
    caps = ConnectionCaps(config)

    async def stream(_request: HttpRequest, response: Response) -> None:
        await response.start(200, {"Content-Type": "text/event-stream"}, None)
        for _ in range(EVENTS):
            await response.write(event())
            await asyncio.sleep(0)
        await response.write(b"data: [DONE]\n\n")

    def connection() -> HttpConnection:
        def nothing(*_: object) -> None:
            return None

        return HttpConnection(
            caps.take("127.0.0.1"),
            stream,
            config,
            OriginPolicy("0.0.0.0", None, ()),
            nothing,
            nothing,
            nothing,
        )

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(connection, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


def starlette_app() -> object:
    import anyio
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def events() -> object:
        for _ in range(EVENTS):
            yield event()
            await anyio.lowlevel.checkpoint()  # (hypercorn's trio worker runs it too)
        yield b"data: [DONE]\n\n"

    async def stream(request: object) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/", stream)])


def serve_uvicorn(port: int, http: str) -> None:
    import uvicorn

    uvicorn.run(starlette_app(), host="127.0.0.1", port=port, http=http, log_level="error")


def serve_hypercorn(port: int, worker: str) -> None:
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.loglevel = "ERROR"
    app = starlette_app()
    if worker == "trio":
        import trio
        from hypercorn.trio import serve as trio_serve

        trio.run(trio_serve, app, config)
    else:
        from hypercorn.asyncio import serve as asyncio_serve

        asyncio.run(asyncio_serve(app, config))  # type: ignore[arg-type]


CANDIDATES = {
    "loom (h11)": ("h11", lambda p: serve_loom(p)),
    "aiohttp": ("aiohttp", lambda p: serve_aiohttp(p)),
    "uvicorn+starlette (h11)": ("uvicorn", lambda p: serve_uvicorn(p, "h11")),
    "uvicorn+starlette (httptools)": ("httptools", lambda p: serve_uvicorn(p, "httptools")),
    "hypercorn+starlette (asyncio)": ("hypercorn", lambda p: serve_hypercorn(p, "asyncio")),
    "hypercorn+starlette (trio)": ("hypercorn", lambda p: serve_hypercorn(p, "trio")),
}


def read_stream(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        tail = b""
        while b"[DONE]" not in tail:
            data = sock.recv(1 << 16)
            if not data:
                raise SystemExit("the stream ended early")
            tail = tail[-16:] + data


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(port: int) -> None:
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listening on {port}")


def measure(name: str, port: int) -> None:
    server = subprocess.Popen([sys.executable, __file__, "--serve", name, str(port)])
    try:
        wait_for(port)
        for streams in (1, 8):
            before, start = cpu_seconds(server.pid), time.perf_counter()
            readers = [
                subprocess.Popen([sys.executable, __file__, "--read", str(port)])
                for _ in range(streams)
            ]
            if any(reader.wait() for reader in readers):
                raise SystemExit(f"{name}: a reader failed")
            cpu, wall = cpu_seconds(server.pid) - before, time.perf_counter() - start
            per_event = cpu / (streams * EVENTS) * 1e6
            print(
                f"{name:32} {streams} streams: {per_event:6.1f} us CPU/event, "
                f"{streams * EVENTS / wall:8.0f} events/s"
            )
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        CANDIDATES[sys.argv[2]][1](int(sys.argv[3]))
    elif sys.argv[1:2] == ["--read"]:
        read_stream(int(sys.argv[2]))
    else:
        for port, (name, (module, _)) in enumerate(CANDIDATES.items(), start=18321):
            try:
                __import__(module)
            except ImportError:
                print(f"{name:32} not installed")
                continue
            measure(name, port)


if __name__ == "__main__":
    main()
