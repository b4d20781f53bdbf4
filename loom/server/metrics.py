"""The metrics port (`--metrics-port`, on `--metrics-host`, 127.0.0.1 unless asked), the
boundary's refusals counter, and the JSON log format.

`/metrics` is served in the server's asyncio thread by a small HTTP/1.1 endpoint that nothing
can use to stall anything: at most `MAX_SCRAPERS` connections at once (more get 503 and are
closed), each given `SCRAPE_SECONDS` from its accept to its close, a request head of at most
`MAX_REQUEST_HEAD` bytes, one response per connection. A scrape never calls into the engine:
the gauges come from the snapshot the engine publishes as it steps (`Engine.published_stats`,
at most every 0.1 s, and whenever it goes idle), and the page is rendered at most every
`RENDER_SECONDS`, so a storm of scrapes costs one render a tenth of a second, not one each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

log = logging.getLogger(__name__)
MAX_SCRAPERS = 16
SCRAPE_SECONDS = 5.0
MAX_REQUEST_HEAD = 8192
RENDER_SECONDS = 0.1


def boundary_refusals(registry: CollectorRegistry) -> Callable[[str], None]:
    """`refused(cause)`: one more refusal by the network boundary, labelled with the limit's
    name (`max_connections`, `reset_streams_judged`, `request_timeout`, ...; see
    loom/server/boundary.py), or `protocol_error` and `draining`."""
    counter = Counter(
        "loom:boundary_refusals",
        "Connections and streams the network boundary refused or closed, by the limit",
        ["cause"],
        registry=registry,
    )

    def refused(cause: str) -> None:
        counter.labels(cause).inc()

    return refused


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.page = b""
        self.rendered_at = float("-inf")
        self.num_scrapers = 0
        self.listener: asyncio.Server | None = None
        self.scrapers: set[Scrape] = set()

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(lambda: Scrape(self), host, port, backlog=64)
        log.info("metrics on http://%s:%d/metrics", *self.address())

    def address(self) -> tuple[str, int]:
        """Where it listens (port 0 picked one)."""
        if self.listener is None or not self.listener.sockets:
            raise RuntimeError("the metrics port is not listening")
        host, port = self.listener.sockets[0].getsockname()[:2]
        return str(host), int(port)

    def render(self) -> bytes:
        now = time.monotonic()
        if now - self.rendered_at >= RENDER_SECONDS:
            self.page = generate_latest(self.registry)
            self.rendered_at = now
        return self.page

    async def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        for scrape in list(self.scrapers):
            if scrape.transport is not None:
                scrape.transport.abort()
        await asyncio.sleep(0)


class Scrape(asyncio.Protocol):
    """One scraper's connection: one request, one response, then closed."""

    def __init__(self, endpoint: MetricsEndpoint) -> None:
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.head = bytearray()
        self.timer: asyncio.TimerHandle | None = None
        self.answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.endpoint.scrapers.add(self)
        self.timer = asyncio.get_running_loop().call_later(SCRAPE_SECONDS, transport.abort)  # type: ignore[attr-defined]
        if len(self.endpoint.scrapers) > MAX_SCRAPERS:
            self.respond(503, b"too many scrapers at once\n")

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            if len(self.head) > MAX_REQUEST_HEAD:
                self.respond(431, b"request head too large\n")
            return
        method, _, rest = bytes(self.head[:end]).partition(b" ")
        target = rest.partition(b" ")[0]
        if method not in (b"GET", b"HEAD"):
            self.respond(405, b"GET /metrics\n")
        elif target.partition(b"?")[0] != b"/metrics":
            self.respond(404, b"GET /metrics\n")
        else:
            self.respond(200, self.endpoint.render(), head_only=method == b"HEAD")

    def respond(self, status: int, body: bytes, *, head_only: bool = False) -> None:
        assert self.transport is not None
        self.answered = True
        content_type = CONTENT_TYPE_PLAIN_0_0_4 if status == 200 else "text/plain"
        head = (
            f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + (b"" if head_only else body))
        self.transport.close()  # once written

    def connection_lost(self, exc: Exception | None) -> None:
        self.endpoint.scrapers.discard(self)
        if self.timer is not None:
            self.timer.cancel()


REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Too Large", 503: "Busy"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and a request's figures."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "request", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)
