"""BlockManager: plain Python, so these run in milliseconds."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loom.core.block_manager import NULL_BLOCK, BlockManager, num_blocks_for


def test_num_blocks_for_rounds_up() -> None:
    assert [num_blocks_for(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_block_manager_allocates_to_exhaustion_and_refuses_when_full() -> None:
    manager = BlockManager(num_blocks=5, block_size=4)
    assert manager.num_total_blocks == 4
    assert manager.allocate("a", 8)  # 2 blocks
    assert manager.allocate("b", 8)  # 2 blocks
    assert manager.num_free_blocks == 0
    assert not manager.allocate("c", 1)
    assert not manager.has_request("c")
    # Growing past the pool is refused and leaves the table as it was.
    assert not manager.allocate("a", 9)
    assert len(manager.block_table("a")) == 2


def test_block_manager_refusal_is_all_or_nothing() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)  # 3 usable
    assert manager.allocate("a", 4)
    assert not manager.allocate("b", 12)  # needs 3, only 2 free
    assert manager.num_free_blocks == 2
    assert manager.block_table("b") == ()


def test_block_manager_grows_tables_only_when_a_block_fills() -> None:
    manager = BlockManager(num_blocks=10, block_size=4)
    assert manager.allocate("a", 3)
    first = manager.block_table("a")
    assert len(first) == 1
    assert manager.allocate("a", 4)
    assert manager.block_table("a") == first
    assert manager.num_blocks_needed("a", 5) == 1
    assert manager.allocate("a", 5)
    assert manager.block_table("a")[:1] == first
    assert len(manager.block_table("a")) == 2
    assert manager.num_slots("a") == 8


def test_block_manager_never_hands_out_the_null_block() -> None:
    manager = BlockManager(num_blocks=8, block_size=1)
    assert manager.allocate("a", 7)
    assert NULL_BLOCK not in manager.block_table("a")
    assert sorted(manager.block_table("a")) == list(range(1, 8))
    assert not manager.allocate("b", 1)


def test_block_manager_free_returns_blocks_and_is_idempotent() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    assert manager.allocate("a", 6)
    assert manager.allocate("b", 4)
    manager.free("a")
    assert manager.num_free_blocks == 3
    manager.free("a")  # double free: harmless
    manager.free("never-seen")  # unknown: harmless
    assert manager.num_free_blocks == 3
    manager.free("b")
    assert manager.num_free_blocks == manager.num_total_blocks
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks))


def test_block_manager_reference_counts_keep_shared_blocks_until_last_holder_frees() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    assert manager.allocate("parent", 4)
    prefix = manager.block_table("parent")
    manager.cache("parent", 0, [b"h0", b"h1"])
    assert manager.cached_prefix([b"h0", b"h1", b"h2"]) == list(prefix)
    assert manager.allocate("child", 6, cached=prefix)  # one private block on the shared prefix
    assert manager.block_table("child")[:2] == prefix
    assert [manager.ref_count(b) for b in prefix] == [2, 2]
    assert manager.num_free_blocks == 2

    manager.free("parent")
    assert [manager.ref_count(b) for b in prefix] == [1, 1]
    assert manager.num_free_blocks == 2  # the prefix is still held by the child
    manager.free("child")
    assert manager.num_free_blocks == manager.num_total_blocks
    assert manager.num_cached_blocks == 2  # free, and still reusable
    assert all(manager.is_evictable(b) for b in prefix)


def test_block_manager_takes_empty_blocks_first_then_evicts_least_recently_released() -> None:
    manager = BlockManager(num_blocks=7, block_size=2)  # 6 usable
    for name in "ab":
        assert manager.allocate(name, 4)
        manager.cache(name, 0, [name.encode() + b"0", name.encode() + b"1"])
    a, b = manager.block_table("a"), manager.block_table("b")
    manager.free("a")  # released first: a's second block, then its first
    manager.free("b")
    assert (manager.num_free_blocks, manager.num_cached_blocks) == (6, 4)
    assert manager.allocate("c", 4)  # the two empty blocks
    assert manager.num_cached_blocks == 4
    assert manager.allocate("d", 2)  # evicts the least recently released: a's last block
    assert manager.block_table("d") == (a[1],)
    assert manager.cached_prefix([b"a0", b"a1"]) == [a[0]]  # a's first block is still there
    assert manager.allocate("e", 6)  # a's first block, then b's, last block first
    assert manager.block_table("e") == (a[0], b[1], b[0])
    assert manager.num_cached_blocks == 0
    assert not manager.allocate("f", 1)


def test_block_manager_never_evicts_a_held_block_and_counts_a_hit_it_revives() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)  # 3 usable
    assert manager.allocate("a", 4)
    manager.cache("a", 0, [b"x", b"y"])
    prefix = manager.block_table("a")
    assert manager.allocate("b", 2, cached=prefix[:1])  # shares a's first block: no new block
    manager.free("a")  # a's second block is evictable; its first is held by b
    assert manager.num_free_blocks == 2
    # Reviving the evictable block costs a free block, as a new one would.
    assert manager.num_blocks_needed("c", 6, cached=prefix) == 2
    assert manager.allocate("c", 6, cached=prefix)
    assert manager.num_free_blocks == 0
    assert not manager.allocate("d", 1)
    manager.free("b")
    manager.free("c")
    assert manager.num_free_blocks == manager.num_total_blocks


def test_block_manager_keeps_the_first_block_cached_under_a_hash() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    assert manager.allocate("a", 2)
    assert manager.allocate("b", 2)  # the same content, computed twice (neither had hit)
    manager.cache("a", 0, [b"same"])
    manager.cache("b", 0, [b"same"])
    assert manager.cached_prefix([b"same"]) == list(manager.block_table("a"))
    manager.free("b")  # b's copy was never cached: it holds nothing reusable
    assert manager.num_cached_blocks == 1


def test_block_manager_without_caching_caches_and_finds_nothing() -> None:
    manager = BlockManager(num_blocks=4, block_size=2, enable_caching=False)
    assert manager.allocate("a", 4)
    manager.cache("a", 0, [b"x", b"y"])
    assert manager.cached_prefix([b"x"]) == []
    manager.free("a")
    assert manager.num_cached_blocks == 0


def test_block_manager_refuses_a_prefix_after_blocks_or_of_uncached_blocks() -> None:
    manager = BlockManager(num_blocks=6, block_size=2)
    assert manager.allocate("a", 2)
    manager.cache("a", 0, [b"x"])
    with pytest.raises(ValueError, match="a prefix comes first"):
        manager.allocate("a", 4, cached=manager.block_table("a"))
    with pytest.raises(ValueError, match="block 2 holds no cached prefix"):
        manager.allocate("b", 2, cached=[2])
    with pytest.raises(ValueError, match="block 0 holds no cached prefix"):
        manager.allocate("b", 2, cached=[NULL_BLOCK])
    assert not manager.has_request("b")


def test_block_manager_rejects_a_pool_without_usable_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=1, block_size=4)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / cache / share / free sequences keep the pool's books balanced
    (a block is free or held, never both; an evictable block is cached and held by no one), and
    the cache never names a block whose content has changed since it was cached under a hash."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(num_blocks=17, block_size=4)
        self.num_tokens: dict[str, int] = {}
        self.hashes: dict[str, list[bytes]] = {}  # what each request's full blocks would hold
        self.every_hashes: list[list[bytes]] = []  # of every request, freed ones included
        self.content: dict[int, bytes] = {}  # what each written full block holds
        self.next_id = 0

    def fresh_hashes(self) -> list[bytes]:
        self.next_id += 1
        return [f"{self.next_id}.{i}".encode() for i in range(12)]

    def handed_out(self, request_id: str, before: tuple[int, ...]) -> None:
        """New blocks hold nothing known yet."""
        for block_id in self.manager.block_table(request_id)[len(before) :]:
            self.content.pop(block_id, None)

    def add(self, request_id: str, num_tokens: int, hashes: list[bytes]) -> None:
        self.num_tokens[request_id] = num_tokens
        self.hashes[request_id] = hashes
        self.every_hashes.append(hashes)

    @rule(num_tokens=st.integers(min_value=1, max_value=40))
    def allocate_new(self, num_tokens: int) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        free_before = self.manager.num_free_blocks
        if self.manager.allocate(request_id, num_tokens):
            self.add(request_id, num_tokens, self.fresh_hashes())
            self.handed_out(request_id, ())
            assert free_before - self.manager.num_free_blocks == num_blocks_for(num_tokens, 4)
        else:
            assert num_blocks_for(num_tokens, 4) > free_before
            assert self.manager.num_free_blocks == free_before
            assert not self.manager.has_request(request_id)

    @precondition(lambda self: self.num_tokens)
    @rule(data=st.data(), extra=st.integers(min_value=1, max_value=9))
    def append(self, data: st.DataObject, extra: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.num_tokens)))
        before = self.manager.block_table(request_id)
        wanted = self.num_tokens[request_id] + extra
        if self.manager.allocate(request_id, wanted):
            self.num_tokens[request_id] = wanted
            assert self.manager.block_table(request_id)[: len(before)] == before
            self.handed_out(request_id, before)
        else:
            assert self.manager.block_table(request_id) == before

    @precondition(lambda self: self.num_tokens)
    @rule(data=st.data())
    def write_and_cache_full_blocks(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.num_tokens)))
        hashes = self.hashes[request_id][: self.num_tokens[request_id] // 4]
        for block_id, block_hash in zip(self.manager.block_table(request_id), hashes, strict=False):
            self.content[block_id] = block_hash
        self.manager.cache(request_id, 0, hashes)

    @precondition(lambda self: self.every_hashes)
    @rule(data=st.data(), extra=st.integers(min_value=1, max_value=9))
    def share_prefix(self, data: st.DataObject, extra: int) -> None:
        """A new request whose prompt starts as another's, live or freed, did."""
        parent = data.draw(st.sampled_from(self.every_hashes))
        prefix = self.manager.cached_prefix(parent)
        assert [self.content.get(b) for b in prefix] == parent[: len(prefix)]
        child = f"r{self.next_id}"
        self.next_id += 1
        wanted = len(prefix) * 4 + extra
        free_before = self.manager.num_free_blocks
        needed = self.manager.num_blocks_needed(child, wanted, prefix)
        if self.manager.allocate(child, wanted, prefix):
            assert self.manager.block_table(child)[: len(prefix)] == tuple(prefix)
            assert free_before - self.manager.num_free_blocks == needed
            self.add(child, wanted, parent[: len(prefix)] + self.fresh_hashes())
            self.handed_out(child, tuple(prefix))
        else:
            assert needed > free_before
            assert not self.manager.has_request(child)

    @precondition(lambda self: self.num_tokens)
    @rule(data=st.data(), twice=st.booleans())
    def free(self, data: st.DataObject, twice: bool) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.num_tokens)))
        self.manager.free(request_id)
        if twice:
            self.manager.free(request_id)
        del self.num_tokens[request_id]

    @invariant()
    def free_plus_used_is_total(self) -> None:
        held = {b for r in self.num_tokens for b in self.manager.block_table(r)} - {NULL_BLOCK}
        assert self.manager.num_free_blocks + len(held) == self.manager.num_total_blocks

    @invariant()
    def tables_cover_tokens_and_skip_the_null_block(self) -> None:
        for request_id, num_tokens in self.num_tokens.items():
            table = self.manager.block_table(request_id)
            assert NULL_BLOCK not in table
            assert len(table) * 4 >= num_tokens

    @invariant()
    def ref_counts_match_holders_and_evictable_blocks_are_cached_and_unheld(self) -> None:
        holders: dict[int, int] = {}
        for request_id in self.num_tokens:
            for block_id in self.manager.block_table(request_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id in range(1, self.manager.num_blocks):
            assert self.manager.ref_count(block_id) == holders.get(block_id, 0)
            if self.manager.is_evictable(block_id):
                assert not holders.get(block_id)
                assert self.manager.cached_hash(block_id) is not None
            elif not holders.get(block_id):  # free and empty
                assert self.manager.cached_hash(block_id) is None

    @invariant()
    def a_cached_block_holds_what_its_hash_says(self) -> None:
        cached = {}
        for block_id in range(1, self.manager.num_blocks):
            block_hash = self.manager.cached_hash(block_id)
            if block_hash is not None:
                assert self.content.get(block_id) == block_hash
                assert self.manager.cached_prefix([block_hash]) == [block_id]
                cached[block_hash] = block_id
        assert self.manager.num_cached_blocks == len(cached)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,  # 40 steps: no limit on a loaded machine
)
test_block_manager_stateful = BlockManagerMachine.TestCase


class SlidingBlockManagerMachine(BlockManagerMachine):
    """The same rules and books with a sliding window of 6, and `slide` among the rules: it
    nulls exactly the leading blocks no later query reads, releasing each once."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(num_blocks=17, block_size=4, sliding_window=6)

    @precondition(lambda self: self.num_tokens)
    @rule(data=st.data())
    def slide(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.num_tokens)))
        before = self.manager.block_table(request_id)
        self.manager.slide(request_id, self.num_tokens[request_id])
        after = self.manager.block_table(request_id)
        unread = max(0, self.num_tokens[request_id] - 6 + 1) // 4  # blocks wholly before the window
        assert after == (NULL_BLOCK,) * unread + before[unread:]
        assert self.manager.num_held_blocks(request_id) == len(before) - unread

    @invariant()
    def tables_cover_tokens_and_skip_the_null_block(self) -> None:
        for request_id, num_tokens in self.num_tokens.items():
            table = self.manager.block_table(request_id)
            held = [b for b in table if b != NULL_BLOCK]
            assert table == (NULL_BLOCK,) * (len(table) - len(held)) + tuple(held)  # nulls lead
            assert len(table) * 4 >= num_tokens


SlidingBlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,  # 40 steps: no limit on a loaded machine
)
test_block_manager_sliding_stateful = SlidingBlockManagerMachine.TestCase


def test_block_manager_slides_out_the_blocks_no_later_query_reads() -> None:
    """The module docstring's example: window 6, 13 tokens computed, the next query reads keys
    8..13; blocks 0 and 1 go, once, and a slid cached block stays cached for a later hit."""
    manager = BlockManager(num_blocks=8, block_size=4, sliding_window=6)
    assert manager.allocate("a", 14)
    table = manager.block_table("a")
    manager.cache("a", 0, [b"h0", b"h1", b"h2"])
    manager.slide("a", 13)
    assert manager.block_table("a") == (NULL_BLOCK, NULL_BLOCK, *table[2:])
    assert manager.num_free_blocks == 3 + 2
    manager.slide("a", 13)  # again: nothing more
    assert manager.num_free_blocks == 5
    assert manager.cached_prefix([b"h0", b"h1", b"h2"]) == list(table[:3])
    manager.free("a")
    assert manager.num_free_blocks == manager.num_total_blocks
