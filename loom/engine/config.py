"""The engine's settings: the KV cache and scheduler (from the core), queue limits, backpressure."""

from __future__ import annotations

import attrs

from loom.core.config import CacheConfig, ConstraintConfig, SchedulerConfig
from loom.core.setting import above, at_least, setting

# Far more than any tokenizer's average (about 4 for English), so that only a prompt that could
# never fit the context is refused before it is tokenised.
CHARS_PER_TOKEN = 16


@attrs.frozen(kw_only=True)
class EngineConfig:
    cache: CacheConfig = attrs.field(factory=CacheConfig)
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    constraints: ConstraintConfig = attrs.field(factory=ConstraintConfig)
    max_waiting_requests: int = setting(
        256, "queue limit in requests; beyond it RESOURCE_EXHAUSTED", check=at_least(1)
    )
    max_waiting_tokens: int = setting(
        1 << 20, "queue limit in queued prompt tokens", check=at_least(1)
    )
    max_prompt_chars: int | None = setting(
        None,
        "longest prompt accepted, in characters (chat roles and contents counted), checked "
        f"before tokenising (default: {CHARS_PER_TOKEN} per token of the context length)",
        check=at_least(1),
    )
    output_buffer_size: int = setting(
        64, "outputs buffered per request before it pauses", check=at_least(1)
    )
    stall_timeout: float = setting(
        30.0,
        "seconds a client may read nothing before its request is aborted",
        check=above(0),
    )
