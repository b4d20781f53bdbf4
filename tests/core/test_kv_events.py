"""The prefix cache's event log (loom/core/kv_events.py): numbered events read by tenant and
from a cursor, a snapshot of the live blocks when the cursor is lost, and the block manager's
evictions in it."""

from __future__ import annotations

from loom.core.block_manager import BlockManager
from loom.core.kv_events import KvEventLog, StoredBlock


def block(name: str, parent: str | None, tenant: str = "a") -> StoredBlock:
    return StoredBlock(
        block_hash=name.encode(),
        parent_hash=None if parent is None else parent.encode(),
        token_ids=(1, 2),
        tenant=tenant,
    )


def test_kv_events_a_reader_gets_its_tenants_events_after_its_cursor_in_order() -> None:
    log = KvEventLog()
    log.stored(block("a1", None))
    log.stored(block("b1", None, tenant="b"))
    log.stored(block("a2", "a1"))
    log.removed(b"a2")
    log.removed(b"never-stored")  # nothing: not live
    events, cursor = log.read(0, "a", limit=10)
    assert [(e.sequence, e.block.block_hash, e.removed) for e in events] == [
        (1, b"a1", False),
        (3, b"a2", False),
        (4, b"a2", True),
    ]
    assert cursor == 4
    assert log.read(cursor, "a", limit=10) == ([], 4)
    everyone, _ = log.read(0, None, limit=10)
    assert len(everyone) == 4


def test_kv_events_a_read_stops_at_its_limit_and_resumes_there() -> None:
    log = KvEventLog()
    for i in range(5):
        log.stored(block(f"x{i}", None))
    first, cursor = log.read(0, "a", limit=2)
    rest, end = log.read(cursor, "a", limit=10)
    assert [e.sequence for e in first + rest] == [1, 2, 3, 4, 5]
    assert end == 5


def test_kv_events_a_reader_further_behind_than_the_log_keeps_gets_none() -> None:
    log = KvEventLog(capacity=3)
    for i in range(5):
        log.stored(block(f"x{i}", None))
    assert log.read(1, "a", limit=10) is None
    assert log.read(2, "a", limit=10) is not None


def test_kv_events_a_snapshot_lists_live_blocks_parents_first_and_no_orphans() -> None:
    log = KvEventLog()
    log.stored(block("r", None))
    log.stored(block("c", "r"))
    log.stored(block("g", "c"))
    log.stored(block("other", None, tenant="b"))
    log.removed(b"c")  # "g" is left without a parent: no prefix can reach it
    blocks, at = log.snapshot("a")
    assert [b.block_hash for b in blocks] == [b"r"]
    assert at == 5
    everyone, _ = log.snapshot(None)
    assert [b.block_hash for b in everyone] == [b"r", b"other"]


def test_kv_events_evicting_a_cached_block_is_an_event() -> None:
    blocks = BlockManager(num_blocks=3, block_size=2)
    assert blocks.allocate("r", 4)
    assert blocks.cache("r", 0, [b"h1", b"h2"]) == [0, 1]
    for i, name in enumerate((b"h1", b"h2")):
        blocks.events.stored(
            StoredBlock(block_hash=name, parent_hash=None, token_ids=(i,), tenant="a")
        )
    blocks.free("r")
    assert blocks.allocate("s", 2)  # takes the least recently released: h2's block
    events, _ = blocks.events.read(0, None, limit=10)
    assert [(e.block.block_hash, e.removed) for e in events] == [
        (b"h1", False),
        (b"h2", False),
        (b"h2", True),
    ]


def test_kv_events_a_salted_block_is_seen_by_an_admin_alone() -> None:
    log = KvEventLog()
    log.stored(
        StoredBlock(block_hash=b"s", parent_hash=None, token_ids=(1,), tenant="a", salted=True)
    )
    log.stored(block("plain", None))
    assert [e.block.block_hash for e in log.read(0, "a", limit=10)[0]] == [b"plain"]
    assert [b.block_hash for b in log.snapshot("a")[0]] == [b"plain"]
    assert [b.block_hash for b in log.snapshot(None)[0]] == [b"s", b"plain"]
