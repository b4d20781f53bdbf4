"""The engine's settings: the KV cache and scheduler (from the core), queue limits, backpressure."""

from __future__ import annotations

import attrs

from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.setting import above, at_least, setting


@attrs.frozen(kw_only=True)
class EngineConfig:
    cache: CacheConfig = attrs.field(factory=CacheConfig)
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    max_waiting_requests: int = setting(
        256, "queue limit in requests; beyond it RESOURCE_EXHAUSTED", check=at_least(1)
    )
    max_waiting_tokens: int = setting(
        1 << 20, "queue limit in queued prompt tokens", check=at_least(1)
    )
    max_prompt_chars: int = setting(
        1 << 20, "longest prompt text accepted, checked before tokenising", check=at_least(1)
    )
    output_buffer_size: int = setting(
        64, "outputs buffered per request before it pauses", check=at_least(1)
    )
    stall_timeout: float = setting(
        30.0,
        "seconds a client may read nothing before its request is aborted",
        check=above(0),
    )
