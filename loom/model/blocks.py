"""Weights in llama.cpp's blocks of 32, and the linear layer that multiplies by them in place.

- Q4_1 (4 bits): each block of 32 weights along the input axis is `d * q + m`, q in 0..15, with
  `d = (max - min) / 15` and `m = min` rounded to float16, as llama.cpp quantises. The default
  model's file holds its layers exactly so: packing the weights transformers dequantised from it
  gives back the file's own blocks, and unpacking them gives those weights again, bit for bit.
- Q8_0 (8 bits): `d * q`, q in -127..127, `d = max|w| / 127` in float16. The default model's
  embedding (its tied LM head) is Q8_0 in the file, and round-trips the same way.

`BlockLinear` computes with the blocks (loom/model/kernels/blocks.cpp: activations quantised to
int8 per block of 32, integer products) up to `Q4_ROWS` rows (`Q8_ROWS` for Q8_0); above
(prefill, large batches) it computes with the dequantised weights on the exact path, which is
faster there. Q4_1 is held repacked (`Repacked`: 8 output rows interleaved, the scales and
minimums in float16, as the file stores them), which the kernel multiplies 8 outputs at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F  # noqa: N812

from loom.model.kernels import load

BLOCK = 32
# Most rows a call each block kernel computes: its crossover with fp32 oneDNN, measured (q4:
# BENCHMARKS run O; the Q8_0 LM head's row-by-row kernel: run G).
Q4_ROWS = 32
Q8_ROWS = 16
BLOCK_ROWS = min(Q4_ROWS, Q8_ROWS)  # rows every block kernel computes: a decode step's
GROUP = 8  # output rows interleaved in the Q4_1 repacking


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


@attrs.frozen
class Repacked:
    """Q4_1 blocks of a [n, K] weight for 8 outputs at a time: `q` [G, K / 32, 128] uint8 (for
    each group of 8 rows, G = ceil(n / 8), the last padded with zeros, and each block: the rows'
    bytes in runs of 4, run i of every row, then run i + 1), `dm` [G, K / 32, 16] float16 (the
    8 rows' scales, then their minimums)."""

    q: torch.Tensor
    dm: torch.Tensor
    n: int


def repack(blocks: Blocks) -> Repacked:
    """Q4_1 blocks in the layout of the kernel's 8-output products (lossless: the scales and
    minimums are float16 values already)."""
    if blocks.m is None:
        raise ValueError("only Q4_1 blocks are repacked")
    n, half = blocks.q.shape
    num_blocks, groups = half // (BLOCK // 2), -(-n // GROUP)
    pad = (0, 0, 0, groups * GROUP - n)
    q = F.pad(blocks.q, pad).reshape(groups, GROUP, num_blocks, 4, 4).permute(0, 2, 3, 1, 4)
    scales = [
        F.pad(t, pad).reshape(groups, GROUP, num_blocks).transpose(1, 2)
        for t in (blocks.d, blocks.m)
    ]
    return Repacked(
        q=q.reshape(groups, num_blocks, GROUP * BLOCK // 2).contiguous(),
        dm=torch.cat(scales, dim=-1).half().contiguous(),
        n=n,
    )


def unrepack(packed: Repacked) -> Blocks:
    """The row-by-row blocks again."""
    groups, num_blocks, _ = packed.q.shape
    q = packed.q.reshape(groups, num_blocks, 4, GROUP, 4).permute(0, 3, 1, 2, 4)
    dm = packed.dm.float().reshape(groups, num_blocks, 2, GROUP).permute(2, 0, 3, 1)
    d, m = dm.reshape(2, groups * GROUP, num_blocks)
    q = q.reshape(groups * GROUP, num_blocks * BLOCK // 2)
    return Blocks(q=q[: packed.n].contiguous(), d=d[: packed.n], m=m[: packed.n])


class BlockLinear:
    """`x @ weight.T + bias` with the weight in blocks (Q4_1 repacked), up to Q4_ROWS rows
    (Q8_0: Q8_ROWS); `dense` (the same weight, unpacked, on the exact path) above."""

    def __init__(
        self,
        blocks: Blocks,
        bias: torch.Tensor | None,
        dense: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        load()
        self.q8 = blocks if blocks.m is None else None
        self.q4 = repack(blocks) if blocks.m is not None else None
        self.bias = bias
        self.dense = dense

    @property
    def blocks(self) -> Blocks:
        """The weight's blocks, row by row."""
        if self.q4 is not None:
            return unrepack(self.q4)
        assert self.q8 is not None
        return self.q8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > (Q4_ROWS if self.q4 is not None else Q8_ROWS):
            return self.dense(x)
        out: torch.Tensor
        if self.q4 is not None:
            q4 = self.q4
            out = torch.ops.loom.q4r8_linear(x, q4.q, q4.dm, q4.n, self.bias)
        else:
            assert self.q8 is not None
            out = torch.ops.loom.q8_linear(x, self.q8.q, self.q8.d, self.bias)
        return out
