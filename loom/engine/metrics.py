"""What the engine tells operators: Prometheus metrics (vLLM's names with a `loom:` prefix, each
labelled with `model_name`) and a log line per ended request.

Histograms and counters of events are observed in the trio thread as the events happen (a
request ends, a token arrives, a step ends), each a few microseconds. The gauges and the
counters the engine keeps anyway (tokens, preemptions, finishes, the prefix cache) are read on
scrape from the snapshot the engine publishes (`Engine.published_stats`): a scrape sees one
consistent snapshot and never calls into the trio thread. loom/server/metrics.py
serves the registry over HTTP.

Requests that end early are counted by cause in `loom:request_aborted_total`:

| cause | the client sees |
|---|---|
| cancelled | its own cancel, disconnect or reset |
| deadline | DEADLINE_EXCEEDED |
| stalled | RESOURCE_EXHAUSTED (it stopped reading) |
| error | UNAVAILABLE (engine stopped or crashed) |
| refused_resource_exhausted | RESOURCE_EXHAUSTED at admission (queue or backlog full) |
| refused_invalid_argument | INVALID_ARGUMENT at admission |
| refused_unavailable | UNAVAILABLE at admission (loading, draining, stopped) |
| refused_internal | INTERNAL at admission (a tokenizer or chat template that failed) |
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loom.core.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError
from loom.core.request import Request, RequestStatus
from loom.core.request_output import RequestOutput
from loom.engine.stats import EngineStats, SpecDecodeStats

log = logging.getLogger(__name__)
LATENCY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
LATENCY_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))
MASK_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
EARLY_ENDS = {
    RequestStatus.FINISHED_ABORTED: "cancelled",
    RequestStatus.FINISHED_DEADLINE: "deadline",
    RequestStatus.FINISHED_STALLED: "stalled",
    RequestStatus.FINISHED_ERROR: "error",
}
REFUSALS: tuple[tuple[type[Exception], str], ...] = (
    (EngineOverloadedError, "refused_resource_exhausted"),
    (InvalidRequestError, "refused_invalid_argument"),
    (EngineDeadError, "refused_unavailable"),
)


class EngineMetrics:
    """The engine's event metrics, in a registry of their own (one per engine)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.model_name = ""
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"loom:{name}", doc, label, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between a request's tokens", LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to end, every ended request", LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled", LATENCY_BUCKETS
        )
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per ended request", TOKEN_BUCKETS
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per ended request", TOKEN_BUCKETS
        )
        self.step = Histogram(
            "loom:step_duration_seconds",
            "One engine step (forward and sampling), by sequences in the batch (a power of 2 "
            "at least that number)",
            [*label, "batch_size"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.masks = histogram(
            "step_mask_seconds",
            "CPU time one step's token masks took, and the consumes of the tokens sampled "
            "under them, all its constrained rows together (steps with none not counted); "
            "step_mask_budget bounds it",
            MASK_BUCKETS,
        )
        self.aborted = Counter(
            "loom:request_aborted",
            "Requests ended early or refused at admission, by cause",
            [*label, "cause"],
            registry=self.registry,
        )
        self.last_token: dict[str, float] = {}  # by request: when its last token came
        # Per token: the labelled series, looked up once (`labels` takes a lock and a dict).
        self.observe_itl: Callable[[float], None] = lambda seconds: None

    def opened(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        """The model is loaded: label with its name, and read the engine's gauges on scrape."""
        self.model_name = model_name
        self.observe_itl = self.itl.labels(model_name).observe
        self.registry.register(EngineCollector(model_name, stats))

    def refused(self, exc: Exception) -> None:
        cause = next((c for kind, c in REFUSALS if isinstance(exc, kind)), "refused_internal")
        self.aborted.labels(self.model_name, cause).inc()

    def refused_by_server(self, status: str) -> None:
        """A request the server refused before the engine saw it (a message too large, too
        many streams on its connection, draining, no message in time), by its gRPC status.
        Thread-safe: the server calls it from its own thread."""
        self.aborted.labels(self.model_name, f"refused_{status.lower()}").inc()

    def cancelled(self) -> None:
        """A request cancelled before it was admitted."""
        self.aborted.labels(self.model_name, "cancelled").inc()

    def token(self, request: Request, now: float) -> None:
        last = self.last_token.get(request.request_id)
        if last is not None:
            self.observe_itl(now - last)
        self.last_token[request.request_id] = now

    def stepped(self, num_seqs: int, seconds: float) -> None:
        batch = str(1 << (num_seqs - 1).bit_length())
        self.step.labels(self.model_name, batch).observe(seconds)

    def masked(self, seconds: float) -> None:
        self.masks.labels(self.model_name).observe(seconds)

    def ended(self, request: Request, now: float) -> None:
        name = self.model_name
        self.last_token.pop(request.request_id, None)
        cause = EARLY_ENDS.get(request.status)
        if cause is not None:
            self.aborted.labels(name, cause).inc()
        if request.first_token_time is not None:
            self.ttft.labels(name).observe(request.first_token_time - request.arrival_time)
        if request.first_scheduled_time is not None:
            self.queue.labels(name).observe(request.first_scheduled_time - request.arrival_time)
        self.e2e.labels(name).observe(now - request.arrival_time)
        self.prompt_tokens.labels(name).observe(request.num_prompt_tokens)
        self.generation_tokens.labels(name).observe(len(request.output_token_ids))


class EngineCollector(Collector):
    """The gauges and the engine's own counters, from one `Engine.stats()` per scrape."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.stats = stats  # called in the scraping thread: reads a published snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:  # nothing published yet
            return
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"loom:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"loom:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("num_requests_running", "Requests in the batch (not paused)", s.num_running)
        yield gauge("num_requests_waiting", "Requests queued or being admitted", s.num_waiting)
        yield gauge("num_requests_paused", "Requests whose client is not reading", s.num_paused)
        used = s.num_total_blocks - s.num_free_blocks
        yield gauge(
            "kv_cache_usage_perc", "Share of KV blocks held (0 to 1)", used / s.num_total_blocks
        )
        yield counter("prompt_tokens", "Prompt tokens admitted", s.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated", s.num_generated_tokens)
        yield counter("num_preemptions", "Preemptions (by recompute)", s.num_preemptions)
        yield counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache", s.prefix_cache_queries
        )
        yield counter("prefix_cache_hits", "Of those, found", s.prefix_cache_hits)
        success = CounterMetricFamily(
            "loom:request_success",
            "Requests that ended normally, by finish reason",
            labels=["model_name", "finished_reason"],
        )
        for reason in ("stop", "length", "stop_sequence"):
            success.add_metric([*label, reason], s.finished.get(reason, 0))
        yield success
        if s.spec_decode is not None:
            yield from spec_decode_families(self.model_name, s.spec_decode)
        yield from tenant_families(self.model_name, s)


def spec_decode_families(model_name: str, s: SpecDecodeStats) -> Iterator[Metric]:
    """vLLM's spec_decode counters (acceptance rate: accepted / draft tokens)."""
    label = [model_name]
    for name, doc, value in (
        ("num_drafts", "Steps of a request with draft tokens", s.num_drafts),
        ("num_draft_tokens", "Draft tokens verified", s.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted", s.num_accepted_tokens),
    ):
        family = CounterMetricFamily(f"loom:spec_decode_{name}", doc, labels=["model_name"])
        family.add_metric(label, value)
        yield family
    per_pos = CounterMetricFamily(
        "loom:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft",
        labels=["model_name", "position"],
    )
    for position, value in enumerate(s.accepted_per_pos):
        per_pos.add_metric([*label, str(position)], value)
    yield per_pos


MAX_TENANT_SERIES = 256  # the tenants with the most tokens get a series; all have their stats


def tenant_families(model_name: str, s: EngineStats) -> Iterator[Metric]:
    """By tenant: running, waiting, tokens and refusals (the operator's view: every tenant)."""
    busiest = sorted(s.tenants.items(), key=lambda item: -item[1].num_prompt_tokens)
    tenants = busiest[:MAX_TENANT_SERIES]
    families = [
        (
            GaugeMetricFamily,
            "tenant_requests_running",
            "A tenant's requests in the batch",
            "num_running",
        ),
        (GaugeMetricFamily, "tenant_requests_waiting", "A tenant's requests queued", "num_waiting"),
        (
            CounterMetricFamily,
            "tenant_prompt_tokens",
            "A tenant's prompt tokens admitted",
            "num_prompt_tokens",
        ),
        (
            CounterMetricFamily,
            "tenant_generation_tokens",
            "A tenant's tokens generated",
            "num_generated_tokens",
        ),
        (
            CounterMetricFamily,
            "tenant_refusals",
            "A tenant's requests refused for its share",
            "num_refused",
        ),
    ]
    for kind, name, doc, field in families:
        family = kind(f"loom:{name}", doc, labels=["model_name", "tenant"])
        for tenant, figures in tenants:
            family.add_metric([model_name, tenant], getattr(figures, field))
        yield family


def log_request(request: Request, final: RequestOutput) -> None:
    """One line per ended request; with `--log-format json`, its figures as fields too."""
    fields = {
        "request_id": request.request_id,
        "finish_reason": str(final.finish_reason),
        "prompt_tokens": request.num_prompt_tokens,
        "cached_tokens": request.num_cached_tokens,
        "generated_tokens": len(request.output_token_ids),
        "queue_ms": round(final.timings.queue_ms, 1) if final.timings else None,
        "ttft_ms": None,
        "e2e_ms": round(final.timings.e2e_ms, 1) if final.timings else None,
    }
    if final.timings is not None and final.timings.ttft_ms is not None:
        fields["ttft_ms"] = round(final.timings.ttft_ms, 1)
    log.info(
        "request %(request_id)s %(finish_reason)s: %(prompt_tokens)d prompt "
        "(%(cached_tokens)d cached) + %(generated_tokens)d generated tokens; queue "
        "%(queue_ms)s ms, first token %(ttft_ms)s ms, end %(e2e_ms)s ms",
        fields,
        extra={"request": fields},
    )
