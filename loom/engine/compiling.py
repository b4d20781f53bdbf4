"""Compiling requests' constraints (loom/model/grammar.py) for admission: shared, bounded, and
fair between tenants.

    Compiler.matcher(constraint, tenant, cache_salt)       key = (tenant, cache_salt, constraint)
        too slow before, under this key   refused at once (INVALID_ARGUMENT)
        compiled, in the cache            a copy of it, at once (no thread)
        compiling, or waiting to          wait on that compile: every copy of a constraint,
                                          every choice of a request, shares one
        else, a new compile               refused (RESOURCE_EXHAUSTED, naming the tenant) if
                                          its tenant has max_pending_compiles already; else
                                          queued, in its tenant's turn

    Threads: at most compile_threads compiles run at once. Tenants take turns (the one whose
    last turn is oldest first), and while another tenant's compile waits, a tenant runs one
    compile at a time: no tenant holds every thread while others wait (alone, it may).

Every key is a tenant's and a salt's as well as the content's: a compile, a cached template or
a refusal is never shared across tenants, so no request is faster, slower or refused for what
another tenant asked (what `cache_salt` does for the prefix cache, for constraints).

A compile cannot be interrupted. Its time limit (constraint_compile_timeout) runs from when
its thread begins it, never while it waits its turn. Past it, its requests are refused, the key
is remembered as too slow, and the compile runs on to its end with its result dropped: its
thread stays its tenant's (counted as pending), and the pool holds as many threads again for
such compiles, so the live ones keep their places. A compile every waiting request has left
(aborted, or deadline passed) before it began is dropped from the queue.
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future
from typing import Any

import attrs
import trio

from loom.core.config import ConstraintConfig
from loom.core.constraint import Constraint, Matcher
from loom.core.errors import EngineOverloadedError, InvalidRequestError
from loom.model.grammar import Grammars, Template

Key = tuple[str, str, Constraint]  # tenant, cache_salt, constraint
MAX_TURNS = 4096  # tenants whose last turn is remembered, before the idle ones are forgotten


@attrs.define(eq=False)
class Compile:
    """One distinct compile and the requests waiting on it."""

    key: Key
    waiters: int = 0
    began: float | None = None  # trio's clock, when a thread began it
    abandoned: bool = False  # past its time limit: its result goes nowhere
    template: Template | None = None
    error: Exception | None = None
    started: trio.Event = attrs.Factory(trio.Event)
    done: trio.Event = attrs.Factory(trio.Event)

    @property
    def tenant(self) -> str:
        return self.key[0]


class Compiler:
    def __init__(self, grammars: Grammars, config: ConstraintConfig) -> None:
        self.grammars = grammars
        self.config = config
        self.cache: OrderedDict[Key, Template] = OrderedDict()
        self.too_slow: OrderedDict[Key, None] = OrderedDict()
        self.compiles: dict[Key, Compile] = {}  # waiting for a thread, or running in time
        self.queued: dict[str, deque[Compile]] = {}  # by tenant; the first tenant's turn next
        self.running: Counter[str] = Counter()  # threads held, abandoned compiles' too
        self.num_live = 0  # running, and within their time limit
        self.num_begun = 0  # compiles begun, ever
        self.turns: dict[str, int] = {}  # the tenants' last turns (num_begun then)
        self.preparing = trio.Lock()  # first in, first out: requests queue in their order

    async def matcher(
        self, constraint: Constraint | None, tenant: str, cache_salt: str
    ) -> Matcher | None:
        """A fresh matcher for the constraint, or why not: invalid, too slow to compile (now,
        or when this tenant last asked), or the tenant has too many compiles pending."""
        if constraint is None:
            return None
        key = (tenant, cache_salt, constraint)
        if key in self.too_slow:
            raise slow(constraint, self.config)
        if (template := self.cache.get(key)) is not None:
            self.cache.move_to_end(key)
            return self.grammars.copy(template)
        # Once per engine, off the compile threads and outside any time limit: the tokenizer
        # as llguidance sees it (half a second). Behind a fair lock, so that the requests that
        # came while it was made queue in the order they came (each returning from its own
        # thread, they queued in any order: a race a compile-order test lost).
        async with self.preparing:
            if self.grammars.ll_tokenizer is None:
                await trio.to_thread.run_sync(self.grammars.prepare)
        job = self.compiles.get(key) or self.enqueue(key)
        job.waiters += 1
        try:
            await self.wait(job)
        finally:
            job.waiters -= 1
            if not job.waiters and job.began is None:  # every request left before it began
                self.drop(job)
        if job.template is None:  # invalid, too slow, or a bug (its exception)
            raise job.error or RuntimeError("a compile ended with no template and no error")
        return self.grammars.copy(job.template)

    def pending(self, tenant: str) -> int:
        """The tenant's compiles waiting for a thread or holding one."""
        return len(self.queued.get(tenant, ())) + self.running[tenant]

    def enqueue(self, key: Key) -> Compile:
        tenant, limit = key[0], self.config.max_pending_compiles
        if (pending := self.pending(tenant)) >= limit:
            raise EngineOverloadedError(
                f"tenant {tenant!r} has {pending} constraints compiling or waiting to; the "
                f"limit is max_pending_compiles={limit} (one past its time limit counts until "
                "it ends)"
            )
        job = Compile(key)
        self.compiles[key] = job
        self.queued.setdefault(tenant, deque()).append(job)
        self.dispatch()
        return job

    async def wait(self, job: Compile) -> None:
        await job.started.wait()
        if job.began is None:  # cannot be: `started` is set as it begins
            raise RuntimeError("a compile started without a start time")
        with trio.move_on_at(job.began + self.config.constraint_compile_timeout):
            await job.done.wait()
        if not job.done.is_set():
            self.abandon(job)

    def abandon(self, job: Compile) -> None:
        """Past its time limit: its requests refused, its key remembered as too slow."""
        job.abandoned = True
        job.error = slow(job.key[2], self.config)
        self.num_live -= 1
        bounded_put(self.too_slow, job.key, None, self.config.constraint_cache_size)
        del self.compiles[job.key]
        job.done.set()
        self.dispatch()  # a live compile's place is free

    def drop(self, job: Compile) -> None:
        queue = self.queued[job.tenant]
        queue.remove(job)
        if not queue:
            del self.queued[job.tenant]
        del self.compiles[job.key]

    # Threads

    def dispatch(self) -> None:
        """Begin queued compiles while there is room: tenants in turn, a tenant's one at a
        time while another's waits."""
        threads = self.config.compile_threads
        while self.num_live < threads and sum(self.running.values()) < 2 * threads:
            job = self.next_job()
            if job is None:
                return
            self.begin(job)

    def next_job(self) -> Compile | None:
        """The first queued compile of the tenant whose last turn is oldest (a tenant's never
        is oldest of all), skipping a tenant that runs one while another tenant waits."""
        others_wait = len(self.queued) > 1
        ready = [t for t in self.queued if not (others_wait and self.running[t])]
        if not ready:
            return None
        tenant = min(ready, key=lambda t: self.turns.get(t, -1))
        queue = self.queued[tenant]
        job = queue.popleft()
        if not queue:
            del self.queued[tenant]
        return job

    def begin(self, job: Compile) -> None:
        job.began = trio.current_time()
        job.started.set()
        self.running[job.tenant] += 1
        self.num_live += 1
        self.turns[job.tenant] = self.num_begun
        self.num_begun += 1
        if len(self.turns) > MAX_TURNS:  # forget the tenants with nothing pending
            self.turns = {t: n for t, n in self.turns.items() if self.pending(t)}
        token = trio.lowlevel.current_trio_token()

        def ended(future: Future[Template]) -> None:
            with contextlib.suppress(trio.RunFinishedError):  # and trio is gone
                token.run_sync_soon(self.finished, job, future)

        constraint = job.key[2]
        self.grammars.compiling.submit(self.grammars.compile, constraint).add_done_callback(ended)

    def finished(self, job: Compile, future: Future[Template]) -> None:
        self.running[job.tenant] -= 1
        if not self.running[job.tenant]:
            del self.running[job.tenant]
        if not job.abandoned:
            self.num_live -= 1
            del self.compiles[job.key]
            try:
                job.template = future.result()
                bounded_put(self.cache, job.key, job.template, self.config.constraint_cache_size)
            except Exception as exc:  # invalid, or a bug (the request then fails INTERNAL)
                job.error = exc
            job.done.set()
        self.dispatch()


def slow(constraint: Constraint, config: ConstraintConfig) -> InvalidRequestError:
    return InvalidRequestError(
        f"{constraint.kind.value} did not compile within constraint_compile_timeout="
        f"{config.constraint_compile_timeout}s"
    )


def bounded_put(entries: OrderedDict[Key, Any], key: Key, value: Any, size: int) -> None:
    """Put `key` in a least-recently-used dict of at most `size` entries."""
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > size:
        entries.popitem(last=False)
