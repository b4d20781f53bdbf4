"""Serving the engine's Prometheus metrics (loom/engine/metrics.py) and the JSON log format.

`/metrics` is served by prometheus_client's own HTTP server: a thread of its own, and a thread
per scrape, so a slow scraper stalls neither the engine's trio thread nor the gRPC loop. A
scrape waits at most for the trio thread's next turn (it reads the engine's stats there).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import start_http_server

from loom.engine.engine import Engine

log = logging.getLogger(__name__)


@contextmanager
def metrics_served(engine: Engine, host: str, port: int) -> Iterator[int]:
    """Serve `engine`'s metrics at http://host:port/metrics until the block ends; yields the
    port (port 0 picks a free one)."""
    httpd, thread = start_http_server(port, addr=host, registry=engine.metrics.registry)
    try:
        log.info("metrics on http://%s:%d/metrics", host, httpd.server_port)
        yield httpd.server_port
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


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
