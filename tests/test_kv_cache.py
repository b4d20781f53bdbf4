"""KV pool sizing and layout."""

from __future__ import annotations

import pytest
import torch

from loom.kv_cache import KVCache, KVCacheShape

CPU = torch.device("cpu")
SMOLLM2_SHAPE = KVCacheShape(
    num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32
)


def test_kv_cache_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    assert SMOLLM2_SHAPE.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4


def test_kv_cache_blocks_for_a_byte_budget() -> None:
    per_block = SMOLLM2_SHAPE.bytes_per_block
    assert SMOLLM2_SHAPE.num_blocks_for(memory_bytes=10 * per_block + 1, device=CPU) == 10


def test_kv_cache_blocks_for_a_fraction_of_free_memory() -> None:
    assert SMOLLM2_SHAPE.num_blocks_for(memory_fraction=0.01, device=CPU) >= 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_bytes": 100}, "holds 0 blocks"),
        ({"memory_fraction": 0.0}, r"fraction must be in \(0, 1\]"),
        ({"memory_fraction": float("nan")}, r"fraction must be in \(0, 1\]"),
        ({"memory_bytes": 1 << 30, "memory_fraction": 0.5}, "exactly one"),
        ({}, "exactly one"),
    ],
)
def test_kv_cache_budget_errors_name_the_limit(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SMOLLM2_SHAPE.num_blocks_for(device=CPU, **kwargs)  # type: ignore[arg-type]


def test_kv_cache_allocates_zeroed_layers_of_the_documented_shape() -> None:
    shape = KVCacheShape(
        num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16
    )
    cache = KVCache.allocate(shape, num_blocks=5, device=CPU)
    assert len(cache.k) == len(cache.v) == 3
    assert cache.k[0].shape == (5, 4, 2, 8)
    assert cache.v[2].dtype == torch.bfloat16
    assert cache.num_blocks == 5
    assert not any(t.any() for t in cache.k + cache.v)
