"""Prometheus metrics from a real server, scraped over HTTP during and after a real workload:
names, types, labels, and counts that match what was sent (aborts and refusals included)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from grpclib import GRPCError, Status
from grpclib.client import Channel
from prometheus_client.parser import text_string_to_metric_families

from loom.engine.config import EngineConfig
from loom.engine.engine import Engine, RunnerFactory
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner
from loom.server.boundary import BoundaryConfig
from loom.server.config import ServerConfig
from loom.server.metrics import RENDER_SECONDS, JsonFormatter
from loom.server.supervisor import Supervisor
from loom.v1.loom_grpc import LoomStub
from tests.support.faults import calling_before_each_step
from tests.support.grpc_client import (
    HOST,
    generate,
    greedy,
    in_asyncio,
    wait_all_blocks_free,
    wait_running,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@asynccontextmanager
async def serving_metrics(
    loaded: LoadedModel, make_runner: RunnerFactory = ModelRunner
) -> AsyncIterator[tuple[int, int]]:
    engine = Engine(EngineConfig(), lambda: loaded, make_runner=make_runner)
    boundary = BoundaryConfig(max_request_bytes=32768)
    config = ServerConfig(port=0, metrics_port=0, drain_timeout=5, boundary=boundary)
    server = Supervisor(engine, config)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.run)
        assert server.metrics_port is not None
        try:
            yield port, server.metrics_port
        finally:
            nursery.cancel_scope.cancel()


async def scrape(metrics_port: int) -> tuple[dict[str, str], Samples]:
    """Each metric family's type, and every sample by name and labels."""

    def get() -> str:
        with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/metrics", timeout=10) as r:
            return str(r.read().decode())

    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(await trio.to_thread.run_sync(get)):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": "tiny-llama", **labels}.items())))]


async def cancel_when_told(port: int, told: threading.Event) -> None:
    """Read one message, wait to be told, then cancel."""
    async with Channel(HOST, port) as channel, LoomStub(channel).Generate.open() as stream:
        await stream.send_message(greedy([5, 6], 500), end=True)
        await stream.recv_message()
        await asyncio.to_thread(told.wait, 30)
        await stream.cancel()


async def test_metrics_names_types_labels_and_counts_match_the_workload(
    tiny_chat: LoadedModel,
) -> None:
    told = threading.Event()  # decode steps wait for it: a request stays running meanwhile
    hold_decodes = calling_before_each_step(
        lambda output: told.wait(30) if output.sequences[0].num_computed_tokens else None
    )
    async with serving_metrics(tiny_chat, hold_decodes) as (port, metrics_port):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(in_asyncio, cancel_when_told, port, told)
                await wait_running(port)
                _, during = await scrape(metrics_port)  # while a request runs
                told.set()
            assert value(during, "loom:num_requests_running") == 1
            assert value(during, "loom:kv_cache_usage_perc") > 0
            for i in range(3):
                await in_asyncio(generate, port, greedy([1 + i, 2, 3], 5))
            with pytest.raises(GRPCError) as refused:
                await in_asyncio(generate, port, greedy([1] * 20000, 5))  # over the context
            assert refused.value.status is Status.INVALID_ARGUMENT
            with pytest.raises(GRPCError) as too_large:  # refused by the server, unread
                await in_asyncio(generate, port, greedy([1] * 40000, 5))
            assert too_large.value.status is Status.RESOURCE_EXHAUSTED
            await wait_all_blocks_free(port)
            await trio.sleep(RENDER_SECONDS)  # a page is at most that old
            types, after = await scrape(metrics_port)

    expected_types = {
        "loom:num_requests_running": "gauge",
        "loom:num_requests_waiting": "gauge",
        "loom:num_requests_paused": "gauge",
        "loom:kv_cache_usage_perc": "gauge",
        "loom:prompt_tokens": "counter",
        "loom:generation_tokens": "counter",
        "loom:num_preemptions": "counter",
        "loom:prefix_cache_queries": "counter",
        "loom:prefix_cache_hits": "counter",
        "loom:request_success": "counter",
        "loom:request_aborted": "counter",
        "loom:time_to_first_token_seconds": "histogram",
        "loom:inter_token_latency_seconds": "histogram",
        "loom:e2e_request_latency_seconds": "histogram",
        "loom:request_queue_time_seconds": "histogram",
        "loom:request_prompt_tokens": "histogram",
        "loom:request_generation_tokens": "histogram",
        "loom:step_duration_seconds": "histogram",
    }
    assert {k: types.get(k) for k in expected_types} == expected_types
    assert value(after, "loom:num_requests_running") == 0
    assert value(after, "loom:kv_cache_usage_perc") == 0.0
    assert value(after, "loom:request_success_total", finished_reason="length") == 3
    assert value(after, "loom:request_success_total", finished_reason="stop") == 0
    assert value(after, "loom:request_aborted_total", cause="cancelled") == 1
    assert value(after, "loom:request_aborted_total", cause="refused_invalid_argument") == 1
    assert value(after, "loom:request_aborted_total", cause="refused_resource_exhausted") == 1
    cancelled_tokens = value(after, "loom:generation_tokens_total") - 3 * 5
    assert cancelled_tokens >= 1  # the cancelled request's, at least its first
    assert value(after, "loom:prompt_tokens_total") == 2 + 3 * 3
    # Four requests ended (three complete, one cancelled); the refused one never started.
    assert value(after, "loom:e2e_request_latency_seconds_count") == 4
    assert value(after, "loom:time_to_first_token_seconds_count") == 4
    assert value(after, "loom:request_prompt_tokens_sum") == 2 + 3 * 3
    assert value(after, "loom:request_generation_tokens_sum") == 3 * 5 + cancelled_tokens
    # One tenant, the clients' address: its series are the server's.
    assert value(after, "loom:tenant_prompt_tokens_total", tenant=HOST) == 2 + 3 * 3
    generated = value(after, "loom:tenant_generation_tokens_total", tenant=HOST)
    assert generated == value(after, "loom:generation_tokens_total")
    assert value(after, "loom:tenant_requests_running", tenant=HOST) == 0
    assert value(after, "loom:tenant_refusals_total", tenant=HOST) == 0
    itl = value(after, "loom:inter_token_latency_seconds_count")
    assert itl == 3 * 4 + cancelled_tokens - 1
    steps = sum(v for (name, _), v in after.items() if name == "loom:step_duration_seconds_count")
    assert steps >= 5  # at least each complete request's 5 tokens' steps
    assert dashboard_metrics() - {name for name, _ in after} == set()


def dashboard_metrics() -> set[str]:
    """The series the example Grafana dashboard queries (examples/grafana/)."""
    path = Path(__file__).parents[2] / "examples" / "grafana" / "loom-dashboard.json"
    panels = json.loads(path.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel["targets"]]
    names = {name for expr in exprs for name in re.findall(r"loom:\w+", expr)}
    assert len(names) > 10
    return names


async def test_metrics_json_logs_carry_a_line_per_request(
    tiny_chat: LoadedModel, caplog: Any
) -> None:
    caplog.set_level("INFO", logger="loom.engine.metrics")
    async with serving_metrics(tiny_chat) as (port, _):
        with trio.fail_after(30):
            await in_asyncio(generate, port, greedy([1, 2, 3], 4))
            await wait_all_blocks_free(port)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("request ")]
    fields: Any = record.request  # type: ignore[attr-defined]
    assert fields["finish_reason"] == "length"
    assert (fields["prompt_tokens"], fields["generated_tokens"]) == (3, 4)
    assert fields["e2e_ms"] >= fields["ttft_ms"] >= fields["queue_ms"] >= 0
    line = JsonFormatter().format(record)
    assert '"finish_reason": "length"' in line
    assert '"generated_tokens": 4' in line
