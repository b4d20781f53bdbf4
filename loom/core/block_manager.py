"""The paged KV cache's bookkeeping: which fixed-size blocks each request owns.

Plain Python, no torch, no trio. The KV pool holds `num_blocks` blocks of `block_size` token
slots each. Block 0 is the null block: block tables are padded with it when they are turned into
tensors, so it is never handed out (a `-1` pad would silently index the last block in a gather).

A request's block table lists, in order, the blocks that hold its tokens: token `i` lives in slot
`block_table[i // block_size] * block_size + i % block_size`. Blocks are reference-counted so that
requests can share full prefix blocks (`share`); a block returns to the free list when its count
falls to zero. Freeing a request releases each of its references exactly once; freeing it again,
or freeing an unknown request, does nothing.
"""

from __future__ import annotations

from collections import deque

import attrs

NULL_BLOCK = 0


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (ceiling division)."""
    return -(-num_tokens // block_size)


@attrs.define
class BlockManager:
    """Hands out KV blocks to requests; refuses, never overcommits."""

    num_blocks: int = attrs.field(validator=attrs.validators.ge(2))
    block_size: int = attrs.field(validator=attrs.validators.ge(1))
    _free: deque[int] = attrs.field(init=False)
    _ref_counts: list[int] = attrs.field(init=False)
    _tables: dict[str, list[int]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self._free = deque(range(1, self.num_blocks))
        self._ref_counts = [0] * self.num_blocks

    @property
    def num_total_blocks(self) -> int:
        """Blocks that can be handed out: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's blocks hold."""
        return len(self._tables.get(request_id, ())) * self.block_size

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks `allocate(request_id, num_tokens)` would take."""
        have = len(self._tables.get(request_id, ()))
        return max(0, num_blocks_for(num_tokens, self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's block table to hold `num_tokens` tokens in all.

        All or nothing: returns False and changes nothing when too few blocks are free.
        """
        needed = self.num_blocks_needed(request_id, num_tokens)
        if needed > self.num_free_blocks:
            return False
        table = self._tables.setdefault(request_id, [])
        for _ in range(needed):
            block_id = self._free.popleft()
            self._ref_counts[block_id] = 1
            table.append(block_id)
        return True

    def share(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        """Append blocks that other requests already hold (full prefix blocks) to this one's."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK or self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is not held by any request; cannot share it")
        table = self._tables.setdefault(request_id, [])
        for block_id in block_ids:
            self._ref_counts[block_id] += 1
            table.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free(self, request_id: str) -> None:
        """Release the request's blocks. Idempotent; unknown ids are ignored."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        for block_id in table:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
