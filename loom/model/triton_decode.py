"""Paged decode attention in Triton: each decode row's query heads over its keys, read in place
from the KV pool through the block table (the GPU's counterpart of the CPU kernel in
loom/model/kernels/step.cpp; gather + SDPA in loom/model/attention.py is the reference).

One program per (row, KV head, split): the row's G query heads that share the KV head are one
[G, D] tile (padded to 16 rows for the tensor cores), so each key and value is read once for
all G. Keys come a tile of TILE positions at a time; position t of row s lives at

    block_tables[s][t // block_size] * block_size + t % block_size      (the pool's slot)

so a tile may span several blocks. The softmax is online, in float32: a running maximum `m`,
sum `l` and weighted sum `acc`, rescaled by exp(m_old - m_new) as each tile comes. A sliding
window starts the keys at `seq_len - window`; the blocks before it are never read (they may be
the null block, or freed). A soft cap turns a score s into `cap * tanh(s / cap)`.

Split-K: with few rows (batch 1 on a GPU of 132 multiprocessors), one program a (row, KV head)
leaves the GPU idle, so a row's keys are cut into `num_splits` ranges, each program writes its
part normalised with its log-sum-exp, and a second kernel combines them. A row of length 0 (a
padded row of a fixed-size step) writes zeros.

Worked example, block_size 4, TILE 4, window 0, 2 splits, a row of 10 keys, table [7, 2, 5]:
split 0 covers positions 0..7 (chunk = ceil(10 / 2) rounded up to a tile: 8), split 1 covers
8..9. Split 0's tiles read slots 28..31 then 8..11; split 1's tile reads 20, 21 (22, 23 masked).

Triton is imported here alone: the CPU path never needs it, and the tests run these kernels
under TRITON_INTERPRET=1 (set before this module is imported) on CPU tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped,unused-ignore]
import triton.language as tl  # type: ignore[import-untyped,unused-ignore]

TILE = 32  # key positions a loop iteration reads
MIN_ROWS = 16  # tl.dot's smallest tile side: a KV head's query heads are padded to it
NO_WINDOW = 1 << 30  # the window of a layer that has none: past every context


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
def tanh(x: Any) -> Any:
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
def dot(a: Any, b: Any, IEEE: tl.constexpr) -> Any:
    """a @ b accumulated in float32; float32 inputs in full precision (not TF32)."""
    if IEEE:  # noqa: SIM108 (a compile-time branch: the other never compiles)
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
def key_range(
    seq_len: Any, window: Any, split: Any, SPLITS: tl.constexpr, TILE_N: tl.constexpr
) -> Any:
    """The positions [start, end) of a row's keys that split `split` reads: the window's keys
    (all, where `window` is NO_WINDOW) cut into SPLITS ranges of whole tiles."""
    first = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, SPLITS), TILE_N) * TILE_N
    start = first + split * chunk
    return start, tl.minimum(start + chunk, seq_len)


@triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
def decode_kernel(
    q_ptr: Any, k_ptr: Any, v_ptr: Any, tables_ptr: Any, lens_ptr: Any,
    out_ptr: Any, part_ptr: Any, lse_ptr: Any,
    scale: Any, softcap: Any, window: Any, block_size: Any,
    stride_q_row: Any, stride_q_head: Any, stride_o_row: Any, stride_o_head: Any,
    stride_table: Any, stride_block: Any, stride_slot: Any, stride_kv_head: Any,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    TILE_N: tl.constexpr, SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
) -> None:  # fmt: skip
    row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = key_range(tl.load(lens_ptr + row).to(tl.int32), window, split, SPLITS, TILE_N)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    head_ok = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q_offsets = row.to(tl.int64) * stride_q_row + heads[:, None] * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_ok, other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    table = tables_ptr + row.to(tl.int64) * stride_table
    for tile_start in range(start, end, TILE_N):
        t = tile_start + tl.arange(0, TILE_N)
        valid = t < end
        block = tl.load(table + t // block_size, mask=valid, other=0).to(tl.int64)
        slots = block * stride_block + (t % block_size) * stride_slot + kv_head * stride_kv_head
        kv_ok = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + slots[:, None] + d[None, :], mask=kv_ok, other=0.0).to(q.dtype)
        scores = dot(q, tl.trans(k), IEEE) * scale
        if SOFTCAP:
            scores = softcap * tanh(scores / softcap)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)  # the old terms' rescaling
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        v = tl.load(v_ptr + slots[:, None] + d[None, :], mask=kv_ok, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v, IEEE)
        m = m_new

    normed = acc / tl.maximum(l, 1e-30)[:, None]  # a split with no keys: l = 0, acc = 0
    if SPLITS == 1:
        o_offsets = row.to(tl.int64) * stride_o_row + heads[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offsets, normed.to(out_ptr.dtype.element_ty), mask=head_ok)
    else:
        num_heads = tl.num_programs(1) * GROUP
        at = (row.to(tl.int64) * num_heads + heads) * SPLITS + split
        tl.store(part_ptr + at[:, None] * HEAD_DIM + d[None, :], normed, mask=head_ok)
        tl.store(lse_ptr + at, m + tl.log(tl.maximum(l, 1e-30)), mask=g < GROUP)  # none: -inf


@triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
def combine_kernel(
    part_ptr: Any, lse_ptr: Any, out_ptr: Any, stride_out_row: Any, stride_out_head: Any,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
) -> None:  # fmt: skip
    """Each (row, query head)'s splits weighted by exp(lse - max lse): the whole softmax."""
    row, head = tl.program_id(0), tl.program_id(1)
    at = (row.to(tl.int64) * tl.num_programs(1) + head) * SPLITS
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    lse = tl.load(lse_ptr + at + s, mask=s < SPLITS, other=float("-inf"))
    top = tl.maximum(tl.max(lse, axis=0), -1e30)  # every split empty (a padded row): finite
    weight = tl.exp(lse - top)  # an empty split's: exp(-inf) = 0
    ok = (s < SPLITS)[:, None] & (d < HEAD_DIM)[None, :]
    parts = tl.load(part_ptr + (at + s)[:, None] * HEAD_DIM + d[None, :], mask=ok, other=0.0)
    total = tl.maximum(tl.sum(weight, axis=0), 1e-30)
    out = tl.sum(parts * weight[:, None], axis=0) / total
    offsets = row.to(tl.int64) * stride_out_row + head * stride_out_head + d
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int = 1,
) -> torch.Tensor:
    """Attention [S, H_q, D] of decode rows `query` [S, H_q, D] over the pool's keys and values
    ([num_blocks, block_size, H_kv, D] each), row s reading its `seq_lens[s]` keys through
    `block_tables[s]` (its last `window` alone, where given; scores soft-capped, where
    `softcap` is); `num_splits` > 1 cuts each row's keys into that many ranges."""
    num_rows, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride(3) != 1 or query.stride(2) != 1 or not block_tables.is_contiguous():
        raise ValueError("the pool, queries and block tables must be contiguous in their last axis")
    group = num_heads // num_kv_heads
    out = query.new_empty(query.shape)  # contiguous, whatever the queries' strides
    splits = max(1, num_splits)
    part = lse = out  # unused with one split
    if splits > 1:
        part = query.new_empty((num_rows, num_heads, splits, head_dim), dtype=torch.float32)
        lse = query.new_empty((num_rows, num_heads, splits), dtype=torch.float32)
    d_pad = max(MIN_ROWS, pow2(head_dim))
    decode_kernel[(num_rows, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part, lse,
        scale, softcap or 0.0, window or NO_WINDOW, block_size,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=max(MIN_ROWS, pow2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        TILE_N=TILE, SPLITS=splits, SOFTCAP=bool(softcap), IEEE=query.dtype == torch.float32,
    )  # fmt: skip
    if splits > 1:
        combine_kernel[(num_rows, num_heads)](
            part, lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS=splits, SPLITS_PAD=pow2(splits),
        )  # fmt: skip
    return out


def num_splits_for(num_rows: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """Splits enough that the programs fill the multiprocessors twice over, each split at least
    four tiles of keys (fewer keys than that are read faster in one program)."""
    programs = num_rows * num_kv_heads
    if programs >= num_sms or max_len <= 4 * TILE:
        return 1
    return max(1, min(-(-2 * num_sms // programs), max_len // (4 * TILE), 16))
