"""The engine's load, as a gateway reads it to route (SMG: the vllm.grpc.engine GetLoads and
KV-event load records, loom/server/vllm/; the HTTP port's /v1/loads and /metrics,
loom/server/openai/loads.py), in the names of vLLM's and SGLang's SchedulerLoad.

The gauges are the server's; what depends on prompts (the prefix cache's hit rate, the queued
prompt tokens) is the viewer's own, every tenant's for an admin (`viewer` None), as the
engine's stats for that viewer are (Engine.stats).
"""

from __future__ import annotations

import datetime
import importlib.metadata
from typing import Any

import attrs

from loom.engine.engine import Engine
from loom.engine.stats import EngineStats, ModelInfo
from loom.server.bridge import TrioBridge


@attrs.frozen(kw_only=True)
class Load:
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    num_used_tokens: int  # KV slots held
    max_total_num_tokens: int  # KV slots in all
    token_usage: float  # the share of KV blocks held, 0 to 1
    utilization: float  # the same
    gen_throughput: float  # tokens generated per second, lately
    cache_hit_rate: float  # prompt tokens found in the prefix cache, of those looked up
    max_running_requests: int
    # An upper bound: whether a queued prompt's start is cached is known once it is scheduled.
    num_waiting_uncached_tokens: int

    @classmethod
    def of(cls, stats: EngineStats, info: ModelInfo) -> Load:
        """From the engine's stats as the caller may see them (Engine.stats)."""
        used = stats.num_total_blocks - stats.num_free_blocks
        usage = used / stats.num_total_blocks if stats.num_total_blocks else 0.0
        return cls(
            num_running_reqs=stats.num_running,
            num_waiting_reqs=stats.num_waiting,
            num_total_reqs=stats.num_running + stats.num_waiting,
            num_used_tokens=used * info.block_size,
            max_total_num_tokens=stats.num_total_blocks * info.block_size,
            token_usage=usage,
            utilization=usage,
            gen_throughput=stats.gen_throughput,
            cache_hit_rate=stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
            max_running_requests=info.max_num_seqs,
            num_waiting_uncached_tokens=stats.num_waiting_tokens,
        )


async def load_now(
    engine: Engine, bridge: TrioBridge, viewer: str | None
) -> tuple[Load, EngineStats]:
    """The load now as `viewer` may see it (None: an admin), and the stats it comes from."""
    info = await bridge.call(engine.model_info)
    stats = await bridge.call(engine.stats, viewer)
    return Load.of(stats, info), stats


def timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


def version() -> str:
    return f"loom {importlib.metadata.version('loom')}"


def loads_document(load: Load) -> dict[str, Any]:
    """The loads as JSON (GetLoadsResponse's shape, as SGLang's /v1/loads): one rank."""
    rank = {"dp_rank": 0, **attrs.asdict(load)}
    return {"timestamp": timestamp(), "version": version(), "dp_rank_count": 1, "loads": [rank]}
