"""Weights in llama.cpp's blocks of 32, and the linear layer that multiplies by them in place.

- Q4_1 (4 bits): each block of 32 weights along the input axis is `d * q + m`, q in 0..15, with
  `d = (max - min) / 15` and `m = min` rounded to float16, as llama.cpp quantises. The default
  model's file holds its layers exactly so: packing the weights transformers dequantised from it
  gives back the file's own blocks, and unpacking them gives those weights again, bit for bit.
- Q8_0 (8 bits): `d * q`, q in -127..127, `d = max|w| / 127` in float16. The default model's
  embedding (its tied LM head) is Q8_0 in the file, and round-trips the same way.

`BlockLinear` computes with the blocks (loom/model/kernels/blocks.cpp: activations quantised to
int8 per block of 32, integer products) up to `BLOCK_ROWS` rows, where a step is bound by the
bytes it reads; above, where a step is bound by arithmetic (prefill, large batches), it computes
with the dequantised weights on the exact path, which is faster there.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from loom.model.kernels import load

BLOCK = 32
BLOCK_ROWS = 16  # most rows the block kernels compute: the crossover with fp32 oneDNN, measured


@attrs.frozen
class Blocks:
    """A [N, K] weight in blocks: `q` (Q4_1: [N, K / 2] uint8, two per byte, q[j] in the low
    nibble and q[j + 16] in the high one, as llama.cpp; Q8_0: [N, K] int8) and the scales
    `d` (and Q4_1's minimums `m`), float32 [N, K / 32]."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None  # None for Q8_0

    @property
    def bits(self) -> int:
        return 4 if self.m is not None else 8


def pack(weight: torch.Tensor, bits: int) -> Blocks:
    """Quantise a float weight [N, K] (K a multiple of 32) to Q4_1 (bits=4) or Q8_0 (bits=8)."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"input size {cols} is not a multiple of the block size {BLOCK}")
    w = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    if bits == 8:
        d = (w.abs().amax(dim=-1) / 127).half().float()
        q = divide(w, d).round().clamp(-127, 127).to(torch.int8)
        return Blocks(q=q.reshape(rows, cols).contiguous(), d=d, m=None)
    if bits != 4:
        raise ValueError(f"blocks are 4 or 8 bits, not {bits}")
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    q = divide(w - m[..., None], d).round().clamp(0, 15).to(torch.uint8)
    nibbles = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return Blocks(q=nibbles.reshape(rows, cols // 2).contiguous(), d=d, m=m)


def divide(w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """w / d per block, 0 where a block's scale is 0 (all its weights alike)."""
    return torch.where(d[..., None] > 0, w / d[..., None].clamp(min=1e-30), 0.0)


def unpack(blocks: Blocks) -> torch.Tensor:
    """The float32 weight [N, K] the blocks stand for."""
    rows, num_blocks = blocks.d.shape
    if blocks.m is None:
        q = blocks.q.reshape(rows, num_blocks, BLOCK).float()
        return (q * blocks.d[..., None]).reshape(rows, -1)
    nibbles = blocks.q.reshape(rows, num_blocks, BLOCK // 2)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()
    return (q * blocks.d[..., None] + blocks.m[..., None]).reshape(rows, -1)


class BlockLinear:
    """`x @ weight.T + bias` with the weight in blocks, up to BLOCK_ROWS rows; `dense` (the same
    weight, unpacked, on the exact path) above."""

    def __init__(
        self,
        blocks: Blocks,
        bias: torch.Tensor | None,
        dense: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        load()
        self.blocks = blocks
        self.bias = bias
        self.dense = dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > BLOCK_ROWS:
            return self.dense(x)
        b = self.blocks
        if b.m is None:
            out: torch.Tensor = torch.ops.loom.q8_linear(x, b.q, b.d, self.bias)
        else:
            out = torch.ops.loom.q4_linear(x, b.q, b.d, b.m, self.bias)
        return out
