"""Weights in llama.cpp's blocks of 32, and the linear layer that multiplies by them in place.

- Q4_1 (4 bits): each block of 32 weights along the input axis is `d * q + m`, q in 0..15, with
  `d = (max - min) / 15` and `m = min` rounded to float16, as llama.cpp quantises. The default
  model's file holds its layers exactly so: packing the weights transformers dequantised from it
  gives back the file's own blocks, and unpacking them gives those weights again, bit for bit.
- Q8_0 (8 bits): `d * q`, q in -127..127, `d = max|w| / 127` in float16. The default model's
  embedding (its tied LM head) is Q8_0 in the file, and round-trips the same way.

`BlockLinear` computes with the blocks at every row count (loom/model/kernels/blocks.cpp:
activations quantised per block of 32, integer products), and holds nothing else: no float copy
of the weight. The blocks are held repacked (`Repacked`: 8 output rows interleaved, the scales
and minimums in float16, as the file stores them), which the kernels multiply 8 outputs at a
time.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F  # noqa: N812

from loom.model.kernels import load

BLOCK = 32
GROUP = 8  # output rows interleaved in the repacking
RUN = {4: 4, 8: 2}  # bytes of a row kept together in the repacking: Q4_1, Q8_0


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
        return (q * blocks.d[..., None]).reshape(rows, num_blocks * BLOCK)
    nibbles = blocks.q.reshape(rows, num_blocks, BLOCK // 2)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()
    return (q * blocks.d[..., None] + blocks.m[..., None]).reshape(rows, num_blocks * BLOCK)


@attrs.frozen
class Repacked:
    """Blocks of a [n, K] weight for 8 outputs at a time: `q` [G, K / 32, 8 * bytes of a block
    row] (for each group of 8 rows, G = ceil(n / 8), the last padded with zeros, and each block:
    the rows' bytes in runs of RUN[bits], run i of every row, then run i + 1; uint8 for Q4_1,
    int8 for Q8_0), `dm` [G, K / 32, 8 or 16] float16 (the 8 rows' scales, then for Q4_1 their
    minimums)."""

    q: torch.Tensor
    dm: torch.Tensor
    n: int

    @property
    def bits(self) -> int:
        return 4 if self.dm.shape[-1] == 2 * GROUP else 8

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` ([T] int64), dequantised: [T, K] float32 (an embedding)."""
        groups, num_blocks, group_bytes = self.q.shape
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < self.n):
            raise IndexError(f"row ids must be in [0, {self.n})")
        group, row = ids // GROUP, ids % GROUP
        q = self.q.view(groups, num_blocks, -1, GROUP, RUN[self.bits])[group, :, :, row]
        dm = self.dm.view(groups, num_blocks, -1, GROUP)[group, :, :, row].float()
        m = dm[..., 1] if self.bits == 4 else None
        q = q.reshape(len(ids), num_blocks * group_bytes // GROUP)
        return unpack(Blocks(q=q, d=dm[..., 0], m=m))


def repack(blocks: Blocks) -> Repacked:
    """Blocks in the layout of the kernels' 8-output products (lossless: the scales and
    minimums are float16 values already)."""
    n, row_bytes = blocks.q.shape
    num_blocks, groups = blocks.d.shape[1], -(-n // GROUP)
    run = RUN[blocks.bits]
    pad = (0, 0, 0, groups * GROUP - n)
    q = F.pad(blocks.q, pad).reshape(groups, GROUP, num_blocks, -1, run).permute(0, 2, 3, 1, 4)
    scales = [
        F.pad(t, pad).reshape(groups, GROUP, num_blocks).transpose(1, 2)
        for t in (blocks.d, blocks.m)
        if t is not None
    ]
    return Repacked(
        q=q.reshape(groups, num_blocks, GROUP * row_bytes // num_blocks).contiguous(),
        dm=torch.cat(scales, dim=-1).half().contiguous(),
        n=n,
    )


def unrepack(packed: Repacked) -> Blocks:
    """The row-by-row blocks again."""
    groups, num_blocks, _ = packed.q.shape
    run = RUN[packed.bits]
    q = packed.q.reshape(groups, num_blocks, -1, GROUP, run).permute(0, 3, 1, 2, 4)
    dm = packed.dm.float().reshape(groups, num_blocks, -1, GROUP).permute(2, 0, 3, 1)
    scales = dm.reshape(dm.shape[0], groups * GROUP, num_blocks)[:, : packed.n]
    q = q.reshape(groups * GROUP, -1)[: packed.n].contiguous()
    return Blocks(q=q, d=scales[0], m=scales[1] if packed.bits == 4 else None)


class BlockLinear:
    """`x @ weight.T + bias` with the weight in blocks, repacked, at every row count."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None = None) -> None:
        load()
        self.packed = repack(blocks)
        self.bias = bias
        self.op = torch.ops.loom.q4r8_linear if blocks.bits == 4 else torch.ops.loom.q8r8_linear

    @property
    def blocks(self) -> Blocks:
        """The weight's blocks, row by row."""
        return unrepack(self.packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        out: torch.Tensor = self.op(x, packed.q, packed.dm, packed.n, self.bias)
        return out
