"""The KV pool: per layer, K and V tensors of `[num_blocks, block_size, num_kv_heads, head_dim]`.

Preallocated once, its size in blocks set by `CacheConfig.num_blocks_for`; zero-filled, so that
masked-out padding never reads NaN garbage. Which request owns which block is the BlockManager's
business; this holds the data.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(kw_only=True)
class KVCacheShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V, every layer, one block."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_layer = self.block_size * self.num_kv_heads * self.head_dim * element_size
        return 2 * self.num_layers * per_layer


@attrs.frozen
class KVCache:
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @classmethod
    def allocate(cls, shape: KVCacheShape, num_blocks: int, device: torch.device) -> KVCache:
        size = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)

        def layers() -> tuple[torch.Tensor, ...]:
            return tuple(
                torch.zeros(size, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)
            )

        return cls(layers(), layers())

    @property
    def num_blocks(self) -> int:
        return int(self.k[0].shape[0])
