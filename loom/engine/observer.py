"""Every engine event that is counted, fed from one place: the Prometheus metrics
(loom/engine/metrics.py), the tenant ledger (loom/engine/stats.py) and the request log; and the
stats a scrape reads, published from the stepping loop.

    admitted  a request enters the scheduler        ledger
    stepped   a step's rows and time                metrics
    masked    a step's grammar time                 metrics
    token     a request's new tokens of a step      metrics, ledger
    refused   a request refused at admission        metrics (and the ledger, for a full queue)
    pushed    a queued request's place taken        ledger
    ended     a request's stream ends               metrics, ledger, the request log
    cancelled an abort before admission             metrics

Every event but a token, every schedule of the stepping loop, and every change of the engine's
own state (serving, draining, stopped) also sets `changed` (then a new one): what
`Engine.until` waits on, so that nothing that waits on the engine's state polls it.

The published stats are one snapshot a scrape reads from another thread: taken again once
`every` has passed or requests have come or gone (counted in O(1): a step can last long), the
per-tenant figures (a pass over every tenant) at most once a `TENANT_STATS_EVERY` while stepping.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import trio

from loom.core.errors import EngineOverloadedError
from loom.core.request import Request
from loom.core.request_output import RequestOutput
from loom.core.scheduler import Scheduler
from loom.engine.metrics import EngineMetrics, log_request
from loom.engine.stats import EngineStats, TenantLedger, TenantStats, Throughput

TENANT_STATS_EVERY = 1.0  # seconds between the published per-tenant figures, while stepping


class Observer:
    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.ledger = TenantLedger()
        self.published: EngineStats | None = None  # read from other threads
        self.published_at = float("-inf")
        self.published_shape = (0, 0, 0)
        self.tenants: dict[str, TenantStats] = {}
        self.tenants_at = float("-inf")
        self.throughput = Throughput()
        self.changed = trio.Event()  # set at the next change of the engine's state

    def state_changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def admitted(self, request: Request) -> None:
        self.ledger.admitted(request.tenant, request.num_prompt_tokens, request.tenancy.weight)
        self.state_changed()

    def stepped(self, num_seqs: int, seconds: float) -> None:
        self.metrics.stepped(num_seqs, seconds)

    def masked(self, seconds: float) -> None:
        self.metrics.masked(seconds)

    def token(self, request: Request, num_tokens: int, now: float) -> None:
        self.metrics.token(request, now)
        self.ledger.generated(request.tenant, num_tokens)

    def refused(self, exc: Exception, tenant: str) -> None:
        self.metrics.refused(exc)
        if isinstance(exc, EngineOverloadedError):
            self.ledger.refusal(tenant)
        self.state_changed()

    def pushed(self, request: Request) -> None:
        """A queued request's place taken by a tenant below its share: a refusal of its
        tenant's (it ends REFUSED, and is counted as it ends)."""
        self.ledger.refusal(request.tenant)
        self.state_changed()

    def ended(self, request: Request, final: RequestOutput, now: float) -> None:
        self.metrics.ended(request, now)
        self.ledger.ended(request)
        log_request(request, final)
        self.state_changed()

    def cancelled(self) -> None:
        self.metrics.cancelled()
        self.state_changed()

    def stats(
        self, scheduler: Scheduler, pending: Counter[str], tenant: str | None = None
    ) -> EngineStats:
        """The figures now; by tenant, every tenant's or (`tenant`) that one's alone."""
        tenants = self.ledger.of(scheduler, pending, tenant)
        spec = self.ledger.spec.get(tenant or "", (0, 0, 0))
        rate = self.rate(scheduler)
        return EngineStats.of(scheduler, pending, tenants, rate, viewer=tenant, spec_of_viewer=spec)

    def rate(self, scheduler: Scheduler) -> float:
        """The generation rate, as the stats report it (every tenant's)."""
        return self.throughput.rate(scheduler.num_generated_tokens, time.monotonic())

    def publish(
        self, scheduler: Scheduler, pending_of: Callable[[], Counter[str]], every: float = 0.0
    ) -> None:
        """Publish the stats for scrapes: now, or, with `every`, once that long has passed or
        requests have come or gone (then, and only then, the pending ones are counted)."""
        now = time.monotonic()
        shape = (len(scheduler.running), len(scheduler.waiting), len(scheduler.requests))
        if now - self.published_at >= every or shape != self.published_shape:
            pending = pending_of()
            if not every or now - self.tenants_at >= TENANT_STATS_EVERY:
                self.tenants = self.ledger.of(scheduler, pending, None)
                self.tenants_at = now
            self.published = EngineStats.of(scheduler, pending, self.tenants, self.rate(scheduler))
            self.published_at, self.published_shape = now, shape
