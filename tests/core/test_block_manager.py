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
    manager.share("child", prefix)
    assert manager.allocate("child", 6)  # one private block on top of the shared prefix
    assert manager.block_table("child")[:2] == prefix
    assert [manager.ref_count(b) for b in prefix] == [2, 2]
    assert manager.num_free_blocks == 2

    manager.free("parent")
    assert [manager.ref_count(b) for b in prefix] == [1, 1]
    assert manager.num_free_blocks == 2  # the prefix is still held by the child
    manager.free("child")
    assert manager.num_free_blocks == manager.num_total_blocks


def test_block_manager_refuses_to_share_unheld_blocks() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    with pytest.raises(ValueError, match="block 2 is not held"):
        manager.share("x", (2,))
    with pytest.raises(ValueError, match="block 0 is not held"):
        manager.share("x", (NULL_BLOCK,))


def test_block_manager_rejects_a_pool_without_usable_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=1, block_size=4)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / share / free sequences keep the pool's books balanced."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(num_blocks=17, block_size=4)
        self.num_tokens: dict[str, int] = {}
        self.shared: set[str] = set()
        self.next_id = 0

    @rule(num_tokens=st.integers(min_value=1, max_value=40))
    def allocate_new(self, num_tokens: int) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        free_before = self.manager.num_free_blocks
        if self.manager.allocate(request_id, num_tokens):
            self.num_tokens[request_id] = num_tokens
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
        else:
            assert self.manager.block_table(request_id) == before

    @precondition(lambda self: self.num_tokens)
    @rule(data=st.data())
    def share_prefix(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.num_tokens)))
        table = self.manager.block_table(parent)
        num_full = self.num_tokens[parent] // 4
        child = f"r{self.next_id}"
        self.next_id += 1
        self.manager.share(child, table[:num_full])
        self.num_tokens[child] = num_full * 4
        self.shared.update({parent, child})

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
        held = {b for r in self.num_tokens for b in self.manager.block_table(r)}
        assert self.manager.num_free_blocks + len(held) == self.manager.num_total_blocks

    @invariant()
    def tables_cover_tokens_and_skip_the_null_block(self) -> None:
        for request_id, num_tokens in self.num_tokens.items():
            table = self.manager.block_table(request_id)
            assert NULL_BLOCK not in table
            assert len(table) * 4 >= num_tokens

    @invariant()
    def ref_counts_match_holders_and_unshared_tables_are_disjoint(self) -> None:
        holders: dict[int, int] = {}
        for request_id in self.num_tokens:
            for block_id in self.manager.block_table(request_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id in range(1, self.manager.num_blocks):
            assert self.manager.ref_count(block_id) == holders.get(block_id, 0)
        private = [
            b for r in self.num_tokens if r not in self.shared for b in self.manager.block_table(r)
        ]
        assert len(private) == len(set(private))
        assert not set(private) & {
            b for r in self.shared if r in self.num_tokens for b in self.manager.block_table(r)
        }


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40)
test_block_manager_stateful = BlockManagerMachine.TestCase
