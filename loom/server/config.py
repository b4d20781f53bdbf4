"""The serving process's settings: where it listens (gRPC, and OpenAI's HTTP API), the network
boundary's limits, tenants, the vLLM engine protocol's, drain, logs, metrics."""

from __future__ import annotations

import attrs

from loom.core.setting import above, in_range, setting
from loom.server.boundary import BoundaryConfig
from loom.server.openai.config import HttpConfig
from loom.server.tenants import TenantConfig
from loom.server.vllm.config import VllmConfig


@attrs.frozen(kw_only=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(50051, "port to listen on; 0 picks a free one", check=in_range(0, 65535))
    boundary: BoundaryConfig = attrs.field(factory=BoundaryConfig)
    tenants: TenantConfig = attrs.field(factory=TenantConfig)
    http: HttpConfig = attrs.field(factory=HttpConfig)
    vllm: VllmConfig = attrs.field(factory=VllmConfig)
    drain_timeout: float = setting(
        30.0, "seconds in-flight requests get to finish on SIGTERM", check=above(0)
    )
    log_level: str = setting(
        "info", "how much to log", choices=("debug", "info", "warning", "error")
    )
    log_format: str = setting(
        "text", "log lines as text, or one JSON object each", choices=("text", "json")
    )
    metrics_port: int | None = setting(
        None,
        "serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0 picks a free port)",
        check=in_range(0, 65535),
    )
    metrics_host: str = setting(
        "127.0.0.1",
        "address the metrics port listens on (not --host: say 0.0.0.0 to let others scrape)",
    )
