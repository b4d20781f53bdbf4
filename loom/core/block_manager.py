"""The paged KV cache's bookkeeping: which fixed-size blocks each request owns, and which full
blocks hold a prefix that later requests may reuse.

Plain Python, no torch, no trio. The KV pool holds `num_blocks` blocks of `block_size` token
slots each. Block 0 is the null block: block tables are padded with it when they are turned into
tensors, so it is never handed out (a `-1` pad would silently index the last block in a gather).

A request's block table lists, in order, the blocks that hold its tokens: token `i` lives in slot
`block_table[i // block_size] * block_size + i % block_size`. Blocks are reference-counted.
Freeing a request releases each of its references exactly once; freeing it again, or freeing an
unknown request, does nothing.

Prefix caching (loom/core/prefix_cache.py makes the hashes). A full block whose K/V is written
can be `cache`d under its content hash; a later request whose prompt starts with the same
blocks takes them (`allocate(..., cached=...)`) instead of computing them again. A cached block
that no request holds any more is not free but evictable: it keeps its content until its space
is needed. Allocation takes blocks that hold nothing first, then evicts cached ones, least
recently released first; a block some request holds is never evicted. `num_free_blocks` counts
both kinds: what allocation can hand out. Each block cached and each cached block evicted is
an event in `events` (loom/core/kv_events.py), which a gateway can follow.

Sliding windows (`sliding_window`, where every layer of the model slides one): a query at
position p reads only keys p - window + 1 .. p, so once a request has computed n tokens no later
query reads a key before n - window + 1. `slide` releases the blocks wholly before that key and
puts the null block in their place: the table keeps its positions (token i still lives in
`block_table[i // block_size]`), and a request holds about window / block_size + 1 blocks
however long it grows. Worked example, block_size 4, window 6, 13 tokens computed: the next
query (position 13) reads keys 8..13; blocks 0 and 1 (tokens 0..7) are released:

    table [7, 2, 9, 4]  ->  [0, 0, 9, 4]

A released block is released as on `free`: a cached one stays cached (evictable) and may serve
another request's prefix hit whole, while it lasts; a hit never takes a null entry (only cached
blocks are offered, each holding its tokens' K/V).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from loom.core.kv_events import KvEventLog

NULL_BLOCK = 0


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


@attrs.define
class BlockManager:
    """Hands out KV blocks to requests; refuses, never overcommits."""

    num_blocks: int = attrs.field(validator=attrs.validators.ge(2))
    block_size: int = attrs.field(validator=attrs.validators.ge(1))
    enable_caching: bool = True
    sliding_window: int | None = None  # every layer reads only this many latest keys
    _empty: deque[int] = attrs.field(init=False)  # free, holding nothing reusable
    _evictable: dict[int, None] = attrs.field(init=False, factory=dict)  # free, cached: LRU first
    _ref_counts: list[int] = attrs.field(init=False)
    _tables: dict[str, list[int]] = attrs.field(init=False, factory=dict)
    _block_of: dict[bytes, int] = attrs.field(init=False, factory=dict)  # content hash -> block
    _hash_of: dict[int, bytes] = attrs.field(init=False, factory=dict)  # and back
    events: KvEventLog = attrs.field(init=False, factory=KvEventLog)

    def __attrs_post_init__(self) -> None:
        self._empty = deque(range(1, self.num_blocks))
        self._ref_counts = [0] * self.num_blocks

    @property
    def num_total_blocks(self) -> int:
        """Blocks that can be handed out: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: empty, or cached and evictable."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a reusable prefix, held by requests or evictable."""
        return len(self._block_of)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's blocks hold."""
        return len(self._tables.get(request_id, ())) * self.block_size

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds (its table's null entries, slid out, are not held)."""
        return sum(b != NULL_BLOCK for b in self._tables.get(request_id, ()))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def cached_hash(self, block_id: int) -> bytes | None:
        """The content hash a block is cached under, if it is."""
        return self._hash_of.get(block_id)

    def cached_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks that hold the longest run of these hashes, from the first."""
        found: list[int] = []
        if self.enable_caching:
            for block_hash in block_hashes:
                block_id = self._block_of.get(block_hash)
                if block_id is None:
                    break
                found.append(block_id)
        return found

    def num_blocks_needed(
        self, request_id: str, num_tokens: int, cached: Sequence[int] = ()
    ) -> int:
        """Free blocks `allocate(request_id, num_tokens, cached)` would take: the new ones, and
        the cached ones that no request holds (they stop being free)."""
        have = len(self._tables.get(request_id, ())) + len(cached)
        new = max(0, num_blocks_for(num_tokens, self.block_size) - have)
        return new + sum(self._ref_counts[b] == 0 for b in cached)

    def allocate(self, request_id: str, num_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow the request's block table to hold `num_tokens` tokens in all: first the `cached`
        blocks (a new request's prefix, from `cached_prefix`), then new ones.

        All or nothing: returns False and changes nothing when too few blocks are free."""
        if cached and self._tables.get(request_id):
            raise ValueError(f"request {request_id} has blocks already; a prefix comes first")
        for block_id in cached:
            if block_id not in self._hash_of:
                raise ValueError(f"block {block_id} holds no cached prefix; cannot share it")
        if self.num_blocks_needed(request_id, num_tokens, cached) > self.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        for block_id in cached:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1
            table.append(block_id)
        for _ in range(num_blocks_for(num_tokens, self.block_size) - len(table)):
            block_id = self.take_free()
            self._ref_counts[block_id] = 1
            table.append(block_id)
        return True

    def take_free(self) -> int:
        if self._empty:
            return self._empty.popleft()
        block_id = next(iter(self._evictable))  # the least recently released
        del self._evictable[block_id]
        block_hash = self._hash_of.pop(block_id)
        del self._block_of[block_hash]
        self.events.removed(block_hash)
        return block_id

    def cache(self, request_id: str, first: int, block_hashes: Sequence[bytes]) -> list[int]:
        """The request's blocks `first, first + 1, ...` are full and written, with these content
        hashes: later requests may take them. A hash already cached in another block keeps that
        block (this one stays private and is freed as usual). Which of `block_hashes` (by
        index) were cached now."""
        if not self.enable_caching:
            return []
        table = self._tables[request_id]
        cached = []
        for i, (block_id, block_hash) in enumerate(zip(table[first:], block_hashes, strict=False)):
            if block_id == NULL_BLOCK:
                continue
            if block_hash not in self._block_of and block_id not in self._hash_of:
                self._block_of[block_hash] = block_id
                self._hash_of[block_id] = block_hash
                cached.append(i)
        return cached

    def slide(self, request_id: str, num_computed_tokens: int) -> None:
        """With a sliding window: release the request's blocks that hold only keys before any
        later query's window (module docstring). Each block is released once: the slid-out
        entries are null, and the walk stops at the first."""
        table = self._tables.get(request_id)
        if self.sliding_window is None or table is None:
            return
        first_read = num_computed_tokens - self.sliding_window + 1  # the next query's first key
        i = min(max(first_read, 0) // self.block_size, len(table)) - 1
        while i >= 0 and table[i] != NULL_BLOCK:
            self.release(table[i])
            table[i] = NULL_BLOCK
            i -= 1

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past those holding its first `num_tokens` tokens
        (taken for draft tokens a step rejected). Such a block holds no full block of the
        request's tokens, so it is never cached."""
        table = self._tables.get(request_id)
        keep = num_blocks_for(num_tokens, self.block_size)
        while table is not None and len(table) > keep:
            block_id = table.pop()
            if block_id in self._hash_of:
                raise ValueError(f"request {request_id}: trimmed block {block_id} is cached")
            self.release(block_id)

    def free(self, request_id: str) -> None:
        """Release the request's blocks. Idempotent; unknown ids are ignored.

        Released last block first: of one request's blocks, the deepest are evicted first (the
        first ones are the likeliest to be shared: a system prompt)."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            if block_id != NULL_BLOCK:  # slid out: released already
                self.release(block_id)

    def release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if block_id in self._hash_of:
                self._evictable[block_id] = None
            else:
                self._empty.append(block_id)
