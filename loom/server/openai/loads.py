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
from loom.server.load import Load, load_now, loads_document

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class LoadReports:
    def __init__(self, engine: Engine, bridge: TrioBridge) -> None:
        self.engine = engine
        self.bridge = bridge

    async def loads(self, viewer: str | None) -> bytes:
        load, _ = await load_now(self.engine, self.bridge, viewer)
        return json.dumps(loads_document(load)).encode()

    async def metrics(self, viewer: str | None, model_name: str) -> bytes:
        load, stats = await load_now(self.engine, self.bridge, viewer)
        registry = CollectorRegistry()
        registry.register(ViewCollector(load, stats, model_name))
        return generate_latest(registry)


class ViewCollector(Collector):
    """One caller's view, once, under vLLM's names (Loom's own, `loom:...`, are the metrics
    port's, every tenant's: a scraper of both never mixes the two views)."""

    def __init__(self, load: Load, stats: EngineStats, model: str) -> None:
        self.load, self.stats, self.model = load, stats, model

    def collect(self) -> Iterator[Metric]:
        load, stats = self.load, self.stats  # (the stats: the caller's own figures)
        gauges = {
            "num_requests_running": ("Requests in the batch", load.num_running_reqs),
            "num_requests_waiting": ("Requests queued", load.num_waiting_reqs),
            "kv_cache_usage_perc": ("Share of KV blocks held (0 to 1)", load.token_usage),
            "gpu_prefix_cache_hit_rate": ("Prefix-cache hits of queries", load.cache_hit_rate),
        }
        counters = {
            "prompt_tokens": ("Prompt tokens admitted", stats.num_prompt_tokens),
            "generation_tokens": ("Tokens generated", stats.num_generated_tokens),
            "prefix_cache_queries": ("Tokens looked up", stats.prefix_cache_queries),
            "prefix_cache_hits": ("Of those, found", stats.prefix_cache_hits),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            gauge.add_metric([self.model], value)
            yield gauge
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            counter.add_metric([self.model], value)
            yield counter
