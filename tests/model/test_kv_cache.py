"""The KV pool: its size per block and its layout."""

from __future__ import annotations

import torch

from loom.core.config import CacheConfig
from loom.model.device import available_memory
from loom.model.kv_cache import KVCache, KVCacheShape

CPU = torch.device("cpu")
SMOLLM2_SHAPE = KVCacheShape(
    num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32
)


def test_kv_cache_bytes_per_block_counts_k_and_v_of_every_layer() -> None:
    assert SMOLLM2_SHAPE.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4


def test_kv_cache_pool_sized_from_a_fraction_of_the_free_memory() -> None:
    free = available_memory(CPU)  # read once: the machine's free memory moves between reads
    num_blocks = CacheConfig(kv_cache_memory_fraction=0.01).num_blocks_for(
        SMOLLM2_SHAPE.bytes_per_block, lambda: free
    )
    assert num_blocks == int(free * 0.01) // SMOLLM2_SHAPE.bytes_per_block


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
