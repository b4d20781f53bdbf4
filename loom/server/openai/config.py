"""The HTTP front's settings: where it listens and what one HTTP request may ask for. The
connection caps, timeouts and the body budget are the network boundary's (loom/server/boundary/
config.py), shared with the gRPC front."""

from __future__ import annotations

import attrs

from loom.core.setting import at_least, in_range, setting


@attrs.frozen(kw_only=True)
class HttpConfig:
    http_port: int | None = setting(
        None,
        "serve OpenAI's HTTP API (/v1/chat/completions, /v1/completions, ...) on this port "
        "too, on the same engine (0 picks a free one)",
        check=in_range(0, 65535),
    )
    http_host: str = setting("127.0.0.1", "address the HTTP API listens on")
    max_choices: int = setting(
        16, "most sequences one HTTP request may ask for (n times its prompts)", check=at_least(1)
    )
    served_model_name: str | None = setting(
        None, "the model's name in the HTTP API (default: the loaded model's own)"
    )
