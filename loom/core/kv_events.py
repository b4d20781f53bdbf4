"""What the prefix cache holds, as events a gateway can follow (SMG's cache-aware routing reads
them from SubscribeKvEvents, loom/server/vllm/kv_feed.py): each full block cached (its content
hash, its parent's, its tokens, its tenant) and each cached block evicted, numbered 1, 2, 3, ...

    BlockManager.cache ──▶ prefix_cache.cache_full_blocks ──▶ stored(block)
    BlockManager.take_free evicting a cached block ──▶ removed(block_hash)

The log keeps the last `capacity` events, for readers that follow it by sequence number, and
every live block (cached, not yet evicted), by tenant, for a reader that starts, or one that
fell further behind than the events kept (`snapshot`). Every event belongs to the tenant whose
request cached the block (the prefix cache is keyed by tenant: no block is shared between
tenants); a reader sees one tenant's unsalted blocks (a request with a `cache_salt` must not be
probed by others of its tenant), or (None: an admin) all. Plain Python, in the engine's thread;
`listeners` are called after each append (a thread-safe waker each: loom/server/bridge.py).
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
    salted: bool = False  # cached by a request with a cache_salt

    def seen_by(self, viewer: str | None) -> bool:
        return viewer is None or (viewer == self.tenant and not self.salted)


@attrs.frozen(kw_only=True)
class KvEvent:
    sequence: int
    block: StoredBlock
    removed: bool  # the block was evicted (else: cached)


class KvEventLog:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.events: deque[KvEvent] = deque(maxlen=capacity)
        # Cached blocks by tenant, parents before children (a child is cached after its parent).
        self.live: dict[str, dict[bytes, StoredBlock]] = {}
        self.tenant_of: dict[bytes, str] = {}
        self.last_sequence = 0
        self.listeners: set[Callable[[], None]] = set()

    def stored(self, block: StoredBlock) -> None:
        self.live.setdefault(block.tenant, {})[block.block_hash] = block
        self.tenant_of[block.block_hash] = block.tenant
        self.append(block, removed=False)

    def removed(self, block_hash: bytes) -> None:
        tenant = self.tenant_of.pop(block_hash, None)
        if tenant is None:
            return
        own = self.live[tenant]
        block = own.pop(block_hash)
        if not own:
            del self.live[tenant]
        self.append(block, removed=True)

    def append(self, block: StoredBlock, *, removed: bool) -> None:
        self.last_sequence += 1
        self.events.append(KvEvent(sequence=self.last_sequence, block=block, removed=removed))
        for listener in self.listeners:
            listener()

    def read(self, after: int, viewer: str | None, limit: int) -> tuple[list[KvEvent], int] | None:
        """The events `viewer` may see after sequence `after` (at most `limit`), and the
        sequence read up to; None when the events after `after` are no longer kept (take a
        snapshot)."""
        if after >= self.last_sequence:
            return [], after
        first = self.last_sequence - len(self.events) + 1  # the oldest kept
        if after + 1 < first:
            return None
        found: list[KvEvent] = []
        sequence = after
        for event in itertools.islice(self.events, after + 1 - first, None):
            if event.block.seen_by(viewer):
                if len(found) == limit:
                    break
                found.append(event)
            sequence = event.sequence
        return found, sequence

    def snapshot(self, viewer: str | None) -> tuple[list[StoredBlock], int]:
        """The live blocks `viewer` may see whose parents are live too (a block whose parent
        was evicted can be hit by no prefix), parents first; and the sequence they stand at.
        A tenant's walks its own blocks alone."""
        tenants = list(self.live) if viewer is None else [viewer]
        blocks: list[StoredBlock] = []
        for tenant in tenants:
            whole: set[bytes] = set()
            for block in self.live.get(tenant, {}).values():
                if block.seen_by(viewer) and (
                    block.parent_hash is None or block.parent_hash in whole
                ):
                    blocks.append(block)
                    whole.add(block.block_hash)
        return blocks, self.last_sequence
