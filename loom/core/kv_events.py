"""What the prefix cache holds, as events a gateway can follow (SMG's cache-aware routing reads
them from SubscribeKvEvents, loom/server/vllm/kv_feed.py): each full block cached (its content
hash, its parent's, its tokens, its tenant) and each cached block evicted, numbered 1, 2, 3, ...

    BlockManager.cache ──▶ prefix_cache.cache_full_blocks ──▶ stored(block)
    BlockManager.take_free evicting a cached block ──▶ removed(block_hash)

The log keeps the last `capacity` events, for readers that follow it by sequence number, and
every live block (cached, not yet evicted: `snapshot`), for a reader that starts, or one that
fell further behind than the events kept. Every event belongs to the tenant whose request
cached the block (the prefix cache is keyed by tenant: no block is shared between tenants), and
a reader sees one tenant's, or (None) all. Plain Python, in the engine's thread; `listeners`
are called after each append (a thread-safe waker each: loom/server/bridge.py).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

import attrs

CAPACITY = 65536  # events kept for readers


@attrs.frozen(kw_only=True)
class StoredBlock:
    block_hash: bytes
    parent_hash: bytes | None  # None: the first block of its request's tokens
    token_ids: tuple[int, ...]
    tenant: str


@attrs.frozen(kw_only=True)
class KvEvent:
    sequence: int
    block_hash: bytes
    tenant: str
    stored: StoredBlock | None  # None: the block was evicted


class KvEventLog:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.events: deque[KvEvent] = deque(maxlen=capacity)
        self.live: dict[bytes, StoredBlock] = {}  # cached blocks, parents before children
        self.last_sequence = 0
        self.listeners: set[Callable[[], None]] = set()

    def stored(self, block: StoredBlock) -> None:
        self.live[block.block_hash] = block
        self.append(block.block_hash, block.tenant, block)

    def removed(self, block_hash: bytes) -> None:
        block = self.live.pop(block_hash, None)
        if block is not None:
            self.append(block_hash, block.tenant, None)

    def append(self, block_hash: bytes, tenant: str, stored: StoredBlock | None) -> None:
        self.last_sequence += 1
        self.events.append(
            KvEvent(
                sequence=self.last_sequence, block_hash=block_hash, tenant=tenant, stored=stored
            )
        )
        for listener in self.listeners:
            listener()

    def read(self, after: int, tenant: str | None, limit: int) -> tuple[list[KvEvent], int] | None:
        """The tenant's events after sequence `after` (at most `limit`), and the sequence read
        up to; None when the events after `after` are no longer kept (take a snapshot)."""
        if after >= self.last_sequence:
            return [], after
        first = self.last_sequence - len(self.events) + 1  # the oldest kept
        if after + 1 < first:
            return None
        found: list[KvEvent] = []
        sequence = after
        for event in itertools.islice(self.events, after + 1 - first, None):
            if tenant is None or event.tenant == tenant:
                if len(found) == limit:
                    break
                found.append(event)
            sequence = event.sequence
        return found, sequence

    def snapshot(self, tenant: str | None) -> tuple[list[StoredBlock], int]:
        """The tenant's live blocks whose parents are live too (a block whose parent was
        evicted can be hit by no prefix), parents first; and the sequence they stand at."""
        blocks: list[StoredBlock] = []
        whole: set[bytes] = set()
        for block in self.live.values():
            if (tenant is None or block.tenant == tenant) and (
                block.parent_hash is None or block.parent_hash in whole
            ):
                blocks.append(block)
                whole.add(block.block_hash)
        return blocks, self.last_sequence
