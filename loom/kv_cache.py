"""The KV pool: per layer, K and V tensors of `[num_blocks, block_size, num_kv_heads, head_dim]`.

Preallocated once, sized from a memory budget, zero-filled (so that masked-out padding never reads
NaN garbage). Which request owns which block is the BlockManager's business; this holds the data.
"""

from __future__ import annotations

import attrs
import torch

from loom.device import available_memory


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

    def num_blocks_for(
        self,
        *,
        memory_bytes: int | None = None,
        memory_fraction: float | None = None,
        device: torch.device,
    ) -> int:
        """Blocks that fit a budget: bytes, or a fraction of the device's free memory."""
        if (memory_bytes is None) == (memory_fraction is None):
            raise ValueError("give exactly one of kv memory bytes or kv memory fraction")
        if memory_bytes is None:
            if not (memory_fraction is not None and 0 < memory_fraction <= 1):
                raise ValueError(f"kv memory fraction must be in (0, 1], got {memory_fraction}")
            memory_bytes = int(available_memory(device) * memory_fraction)
        num_blocks = memory_bytes // self.bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"kv memory of {memory_bytes} bytes holds {num_blocks} blocks of "
                f"{self.bytes_per_block} bytes; at least 2 are needed (one is the null block)"
            )
        return num_blocks


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
