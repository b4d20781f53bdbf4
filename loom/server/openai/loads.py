"""The HTTP port's load reports, for a gateway in front of Loom's HTTP API (SMG in its HTTP
mode polls both): `GET /v1/loads`, the loads as JSON (loom/server/load.py), and `GET /metrics`,
the caller's view in Prometheus text under vLLM's names (`vllm:num_requests_running`,
`vllm:kv_cache_usage_perc`, ...). Behind the same keys as the API.

The caller's view: the server's gauges, and its own token and prefix-cache counters (an
admin's: everyone's). The operator's page, every tenant's series, is the metrics port's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loom.engine.engine import Engine
from loom.engine.stats import EngineStats
from loom.server.bridge import TrioBridge
from loom.server.load import Load, Throughput, loads_document

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class LoadReports:
    def __init__(self, engine: Engine, bridge: TrioBridge) -> None:
        self.engine = engine
        self.bridge = bridge
        self.throughput = Throughput()

    async def load(self, viewer: str | None) -> tuple[Load, EngineStats]:
        info = await self.bridge.call(self.engine.model_info)
        stats = await self.bridge.call(self.engine.stats, viewer)
        rate = self.throughput.rate(stats.num_generated_tokens)
        return Load.of(stats, info, rate, viewer), stats

    async def loads(self, viewer: str | None) -> bytes:
        load, _ = await self.load(viewer)
        return json.dumps(loads_document(load)).encode()

    async def metrics(self, viewer: str | None, model_name: str) -> bytes:
        load, stats = await self.load(viewer)
        registry = CollectorRegistry()
        registry.register(ViewCollector(load, stats, viewer, model_name))
        return generate_latest(registry)


class ViewCollector(Collector):
    """One caller's view, once, under vLLM's names (Loom's own, `loom:...`, are the metrics
    port's, every tenant's: a scraper of both never mixes the two views)."""

    def __init__(self, load: Load, stats: EngineStats, viewer: str | None, model: str) -> None:
        self.load, self.stats, self.viewer, self.model = load, stats, viewer, model

    def collect(self) -> Iterator[Metric]:
        load, stats = self.load, self.stats
        prompt, generated = stats.num_prompt_tokens, stats.num_generated_tokens
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        if self.viewer is not None:
            own = stats.tenants[self.viewer]
            prompt, generated = own.num_prompt_tokens, own.num_generated_tokens
            queries, hits = own.num_prompt_tokens, own.num_cached_tokens
        gauges = {
            "num_requests_running": ("Requests in the batch", load.num_running_reqs),
            "num_requests_waiting": ("Requests queued", load.num_waiting_reqs),
            "kv_cache_usage_perc": ("Share of KV blocks held (0 to 1)", load.token_usage),
            "gpu_prefix_cache_hit_rate": ("Prefix-cache hits of queries", load.cache_hit_rate),
        }
        counters = {
            "prompt_tokens": ("Prompt tokens admitted", prompt),
            "generation_tokens": ("Tokens generated", generated),
            "prefix_cache_queries": ("Tokens looked up in the prefix cache", queries),
            "prefix_cache_hits": ("Of those, found", hits),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            gauge.add_metric([self.model], value)
            yield gauge
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            counter.add_metric([self.model], value)
            yield counter
