"""The serving process's settings: where it listens, what one client may ask of it, drain."""

from __future__ import annotations

import attrs

from loom.core.setting import above, at_least, byte_size, in_range, setting


@attrs.frozen(kw_only=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50051, "port to listen on; 0 picks a free one", check=in_range(0, 65535))
    drain_timeout: float = setting(
        30.0, "seconds in-flight requests get to finish on SIGTERM", check=above(0)
    )
    max_streams_per_connection: int = setting(
        32,
        "streams one client connection may have open at once (HTTP/2 MAX_CONCURRENT_STREAMS; "
        "grpclib clients queue the rest)",
        check=at_least(1),
    )
    max_request_bytes: int = setting(
        4 << 20,
        "largest request message accepted, e.g. 4MiB; larger ones are refused unread",
        check=at_least(1),
        parse=byte_size,
    )
    log_level: str = setting(
        "info", "how much to log", choices=("debug", "info", "warning", "error")
    )
    log_format: str = setting(
        "text", "log lines as text, or one JSON object each", choices=("text", "json")
    )
    metrics_port: int | None = setting(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics (0 picks a free port)",
        check=in_range(0, 65535),
    )
