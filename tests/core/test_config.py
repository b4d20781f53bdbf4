"""The core's settings: the KV pool's size precedence and the checks of every setting."""

from __future__ import annotations

import math

import pytest

from loom.core.config import CacheConfig, SchedulerConfig

PER_BLOCK = 1000


def never() -> int:
    raise AssertionError("free memory was asked for, but a fixed size was set")


def test_cache_config_num_blocks_wins_over_every_memory_setting() -> None:
    config = CacheConfig(num_blocks=7, kv_cache_memory=1 << 30, kv_cache_memory_fraction=0.5)
    assert config.num_blocks_for(PER_BLOCK, never) == 7


def test_cache_config_bytes_win_over_the_fraction() -> None:
    config = CacheConfig(kv_cache_memory=10 * PER_BLOCK + 1, kv_cache_memory_fraction=0.5)
    assert config.num_blocks_for(PER_BLOCK, never) == 10


def test_cache_config_fraction_of_free_memory_is_the_fallback() -> None:
    assert CacheConfig().num_blocks_for(PER_BLOCK, lambda: 1_000_000) == 100  # 0.1 by default
    config = CacheConfig(kv_cache_memory_fraction=0.5)
    assert config.num_blocks_for(PER_BLOCK, lambda: 1_000_000) == 500


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (CacheConfig(kv_cache_memory=1999), "kv_cache_memory: 1999 bytes hold 1 KV blocks"),
        (CacheConfig(kv_cache_memory_fraction=0.001), "kv_cache_memory_fraction=0.001 of free"),
    ],
)
def test_cache_config_refuses_a_budget_below_two_blocks(config: CacheConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config.num_blocks_for(PER_BLOCK, lambda: 1_000_000)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CacheConfig(block_size=0), "block_size must be at least 1, got 0"),
        (lambda: CacheConfig(num_blocks=1), "num_blocks must be at least 2, got 1"),
        (lambda: CacheConfig(kv_cache_memory=0), "kv_cache_memory must be at least 1, got 0"),
        (
            lambda: CacheConfig(kv_cache_memory_fraction=0.0),
            r"kv_cache_memory_fraction must be in \(0, 1\], got 0.0",
        ),
        (
            lambda: CacheConfig(kv_cache_memory_fraction=math.nan),
            r"kv_cache_memory_fraction must be in \(0, 1\], got nan",
        ),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be at least 1, got 0"),
        (
            lambda: SchedulerConfig(max_num_batched_tokens=math.nan),
            "max_num_batched_tokens must be at least 1, got nan",
        ),
    ],
)
def test_config_checks_name_the_setting_and_the_limit(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]
