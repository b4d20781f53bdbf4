"""The engine's settings: KV pool, batching limits, queue limits, backpressure."""

from __future__ import annotations

import attrs
from attrs.validators import ge, gt

from loom.scheduler import SchedulerConfig


@attrs.frozen(kw_only=True)
class EngineConfig:
    block_size: int = attrs.field(default=16, validator=ge(1))
    num_blocks: int | None = None  # a fixed pool size; else sized from the memory budget
    kv_cache_memory: int | None = None  # bytes; else a fraction of the free memory
    kv_cache_memory_fraction: float = attrs.field(
        default=0.1, validator=[gt(0), attrs.validators.le(1)]
    )
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    max_waiting_requests: int = attrs.field(default=256, validator=ge(1))
    max_waiting_tokens: int = attrs.field(default=1 << 20, validator=ge(1))  # queued prompt tokens
    max_prompt_chars: int = attrs.field(default=1 << 20, validator=ge(1))  # text, checked at once
    output_buffer_size: int = attrs.field(default=64, validator=ge(1))  # outputs per request
    stall_timeout: float = attrs.field(default=30.0, validator=gt(0))  # seconds paused, then abort
