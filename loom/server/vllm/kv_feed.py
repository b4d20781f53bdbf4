"""SubscribeKvEvents: the prefix cache's events (loom/core/kv_events.py) as KvEventBatches, the
feed of SMG's cache-aware routing, each batch with the engine's load (EngineLoad).

    first batch: a snapshot: KvCacheCleared, then every live block of the caller's, parents
        first (in chunks of CHUNK events, each marked KvSnapshotChunk, its events numbered 0)
    then: the caller's new events as they come (all that piled up, one batch); or, idle for
        HEARTBEAT seconds, a load-only batch repeating the last sequence number
    fallen behind the events the log keeps: a new snapshot

Sequence numbers are this stream's own, rising by one per batch from `start_sequence_number`
+ 1: a gateway that resubscribes with the last one it saw gets a snapshot that continues its
count with no gap (so replay from any cursor is a snapshot; the log is not per subscriber).

What a subscriber sees: its own tenant's blocks (an admin's stream: every tenant's), each
named by an opaque 64-bit hash, a keyed digest of Loom's own block hash (itself keyed: neither
says anything of the tokens, nor matches anything another server or stream could compute),
with the block's token ids, which are the subscriber's own. A gateway without a key is the
tenant of its address: it sees the blocks its own requests cached. The gateway matches
requests to blocks by the token ids (it hashes them itself), so the opaque hash only has to
name a block for its children and its eviction.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from grpclib import GRPCError, Status

from loom.core.kv_events import KvEvent, KvEventLog, StoredBlock
from loom.server.vllm.config import VllmConfig
from loom.smg import common_pb2 as common
from loom.smg import vllm_engine_pb2 as pb

CHUNK = 1024  # events in one batch of a snapshot, or of new events
HEARTBEAT = 1.0  # seconds of quiet before a load-only batch
KEY = os.urandom(32)


class Subscriptions:
    """The streams open, in all and by tenant, within `VllmConfig`'s caps (an admin's count
    against its own cap alone: no tenant can keep the operator's gateway out), and a tenant's
    new ones at most one each `kv_subscribe_interval` (each begins with a snapshot of its
    blocks, walked in the engine's thread)."""

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self.by_tenant: Counter[str] = Counter()
        self.last: dict[str, float] = {}  # each tenant's latest subscription, lately

    @contextlib.contextmanager
    def held(self, tenant: str, admin: bool, now: float) -> Iterator[None]:
        config = self.config
        limit = config.max_kv_subscriptions
        if not admin and self.by_tenant.total() >= limit:
            refuse(f"{limit} KV event streams are open; the limit is max_kv_subscriptions")
        own = config.max_kv_subscriptions_per_tenant
        if self.by_tenant[tenant] >= own:
            refuse(
                f"this tenant has {own} KV event streams open; the limit is "
                "max_kv_subscriptions_per_tenant"
            )
        interval = config.kv_subscribe_interval
        self.last = {t: at for t, at in self.last.items() if now - at < interval}
        if tenant in self.last:
            refuse(f"one new KV event stream a tenant every kv_subscribe_interval={interval}s")
        self.last[tenant] = now
        self.by_tenant[tenant] += 1
        try:
            yield
        finally:
            self.by_tenant[tenant] -= 1
            if not self.by_tenant[tenant]:
                del self.by_tenant[tenant]


def refuse(message: str) -> None:
    raise GRPCError(Status.RESOURCE_EXHAUSTED, message)


def opaque(block_hash: bytes) -> int:
    """A block's name on the wire: a signed 64-bit keyed digest of its hash."""
    digest = hashlib.blake2b(block_hash, digest_size=8, key=KEY).digest()
    return int.from_bytes(digest, "big", signed=True)


class KvFeed:
    """One subscriber's stream: `send` sends a KvEventBatch, `call` runs a function in the
    engine's thread and returns its result (the bridge), `loads` gives the engine's load now
    (a SchedulerLoad), and `wake` is set when the log has grown."""

    def __init__(
        self,
        log: KvEventLog,
        viewer: str | None,
        start: int,
        send: Callable[[common.KvEventBatch], Awaitable[None]],
        call: Callable[..., Awaitable[Any]],
        loads: Callable[[], Awaitable[pb.SchedulerLoad]],
    ) -> None:
        self.log = log
        self.viewer = viewer
        self.sequence = start  # the last batch's
        self.send, self.call, self.loads = send, call, loads
        self.event_id = 0
        self.sample = 0  # the last load record's
        self.cursor = 0  # the log's sequence read up to

    async def run(self, wake: asyncio.Event, closing: Callable[[], bool]) -> None:
        """Until the client goes, or the server drains (`closing`: the stream ends, OK)."""
        await self.send_snapshot()
        while not closing():
            wake.clear()  # before the read: what comes after it sets it again
            read = await self.call(self.log.read, self.cursor, self.viewer, CHUNK)
            if read is None:
                await self.send_snapshot()
                continue
            events, self.cursor = read
            if events:
                record = await self.record(telemetry=False)
                await self.send(self.batch([self.event_of(e) for e in events], record))
                continue
            try:
                await asyncio.wait_for(wake.wait(), HEARTBEAT)
            except TimeoutError:
                record = await self.record(telemetry=True, load_only=True)
                heartbeat = common.KvEventBatch(
                    sequence_number=self.sequence, timestamp=time.time(), load=record
                )
                await self.send(heartbeat)

    async def send_snapshot(self) -> None:
        """KvCacheCleared, then the viewer's live blocks, in chunks, each made as it is sent."""
        blocks, self.cursor = await self.call(self.log.snapshot, self.viewer)
        record = await self.record(telemetry=True)
        count = max(-(-(len(blocks) + 1) // CHUNK), 1)
        cleared = common.KvCacheEvent(event_id=0, cleared=common.KvCacheCleared())
        for index in range(count):
            start = max(index * CHUNK - 1, 0)
            part = blocks[start : (index + 1) * CHUNK - 1]
            events = [cleared] if index == 0 else []
            events += [self.stored(block, snapshot=True) for block in part]
            batch = self.batch(events, record)
            batch.snapshot.CopyFrom(
                common.KvSnapshotChunk(index=index, count=count, blocks=len(blocks))
            )
            await self.send(batch)

    async def record(self, *, telemetry: bool, load_only: bool = False) -> common.EngineLoad:
        """The engine's load as a record of this stream's (`telemetry`: with the figures no
        routing reads, on a snapshot and a heartbeat)."""
        load = await self.loads()
        self.sample += 1
        record = common.EngineLoad(
            running_requests=load.num_running_reqs,
            waiting_requests=load.num_waiting_reqs,
            waiting_uncached_tokens=load.num_waiting_uncached_tokens,
            token_usage=load.token_usage,
            gen_throughput=load.gen_throughput,
            max_running_requests=load.max_running_requests,
            sample=self.sample,
            load_only=load_only,
        )
        if telemetry:
            record.cache_hit_rate = load.cache_hit_rate
            record.num_used_tokens = load.num_used_tokens
            record.max_total_num_tokens = load.max_total_num_tokens
        return record

    def batch(self, events: Sequence[common.KvCacheEvent], record: Any) -> common.KvEventBatch:
        self.sequence += 1
        return common.KvEventBatch(
            sequence_number=self.sequence, timestamp=time.time(), events=events, load=record
        )

    def event_of(self, event: KvEvent) -> common.KvCacheEvent:
        if not event.removed:
            return self.stored(event.block)
        removed = common.KvBlocksRemoved(
            block_hashes=[opaque(event.block.block_hash)],
            tier=common.KV_CACHE_TIER_DEVICE,
            locality=common.KV_CACHE_LOCALITY_LOCAL,
        )
        return common.KvCacheEvent(event_id=self.next_id(), removed=removed)

    def stored(self, block: StoredBlock, snapshot: bool = False) -> common.KvCacheEvent:
        stored = common.KvBlocksStored(
            blocks=[
                common.KvBlock(
                    block_hash=opaque(block.block_hash),
                    token_ids=block.token_ids,
                    block_size=len(block.token_ids),
                )
            ],
            tier=common.KV_CACHE_TIER_DEVICE,
            locality=common.KV_CACHE_LOCALITY_LOCAL,
        )
        if block.parent_hash is not None:
            stored.parent_block_hash = opaque(block.parent_hash)
        event_id = 0 if snapshot else self.next_id()  # a snapshot's events are synthesized
        return common.KvCacheEvent(event_id=event_id, stored=stored)

    def next_id(self) -> int:
        self.event_id += 1
        return self.event_id
