"""The decoder's small operations fused in Triton, for the GPU: the same three that Loom's C++
kernels fuse on the CPU (loom/model/kernels/step.cpp), with the same signatures, so that
DecoderModel calls either through `ops` (loom/model/decoder.py).

- `add_rms_norm(x, delta, weight, eps)`: `x += delta` in place (the residual stream), then
  RMSNorm of it as transformers computes it: the sum rounded to x's dtype, normalised in
  float32, rounded, then scaled by the weight. One program a row; 1 read of x and delta, 1 write
  of x and of the output, where torch's ops read and write the row about six times.
- `silu_mul(gate_up)`: `silu(gate) * up` for gate_up [T, 2I] (gate, then up), SiLU in float32.
- `rotary_write_kv(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads)`: rotary on q and
  k (cos and signed sin [T, 1, D], as loom/model/decoder.py makes them: `x * cos + roll(x, D/2)
  * sin`), k and v written to their slots in the pool, q returned [T, H_q, D]. One program a
  token: qkv read once, where torch's ops make four intermediates.

All three keep each row's arithmetic in float32 and round where transformers' modules round, so
they agree with the unfused path to rounding (tested under TRITON_INTERPRET=1 on the CPU).
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-untyped,unused-ignore]
import triton.language as tl  # type: ignore[import-untyped,unused-ignore]

from loom.model.triton_decode import pow2

JIT = triton.jit


@JIT  # type: ignore[misc,untyped-decorator,unused-ignore]
def add_rms_norm_kernel(
    x_ptr: Any, delta_ptr: Any, weight_ptr: Any, out_ptr: Any, width: Any, eps: Any,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
) -> None:  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * width + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * width + cols, x, mask=ok)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / width + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = weight * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`x += delta` (where given), then RMSNorm of x [T, H] scaled by `weight`."""
    if not x.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        raise ValueError("add_rms_norm takes contiguous rows")
    out = torch.empty_like(x)
    width = x.shape[-1]
    add_rms_norm_kernel[(x.shape[0],)](
        x, x if delta is None else delta, weight, out, width, eps,
        HAS_DELTA=delta is not None, BLOCK=pow2(width),
    )  # fmt: skip
    return out


@JIT  # type: ignore[misc,untyped-decorator,unused-ignore]
def silu_mul_kernel(gate_up_ptr: Any, out_ptr: Any, width: Any, BLOCK: tl.constexpr) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=ok, other=0.0)
    silu = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty)  # torch's silu, rounded
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [T, 2I], gate first."""
    if not gate_up.is_contiguous():
        raise ValueError("silu_mul takes contiguous rows")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    block = min(1024, pow2(width))
    silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
    return out


@JIT  # type: ignore[misc,untyped-decorator,unused-ignore]
def rotary_write_kernel(
    qkv_ptr: Any, cos_ptr: Any, sin_ptr: Any, slots_ptr: Any, k_ptr: Any, v_ptr: Any, q_ptr: Any,
    num_heads: Any, num_kv_heads: Any,
    HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    SATURATE: tl.constexpr,
) -> None:  # fmt: skip
    """Token t: its q and k heads rotated (the roll by D/2 read as the other half), q stored,
    k and v stored at the token's slot (SATURATE: clamped to float16's range first); cos and
    sin [T, D]."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    rolled = (d + HEAD_DIM // 2) % HEAD_DIM
    width = (num_heads + 2 * num_kv_heads) * HEAD_DIM
    row = qkv_ptr + t * width
    cos = tl.load(cos_ptr + t * HEAD_DIM + d).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * HEAD_DIM + d).to(tl.float32)[None, :]
    kind = q_ptr.dtype.element_ty
    h = tl.arange(0, HEADS_PAD)[:, None]
    ok = h < num_heads
    x = tl.load(row + h * HEAD_DIM + d[None, :], mask=ok, other=0.0).to(tl.float32)
    x_rolled = tl.load(row + h * HEAD_DIM + rolled[None, :], mask=ok, other=0.0).to(tl.float32)
    turned = (x * cos).to(kind).to(tl.float32) + (x_rolled * sin).to(kind).to(tl.float32)
    tl.store(q_ptr + (t * num_heads + h) * HEAD_DIM + d[None, :], turned.to(kind), mask=ok)
    kh = tl.arange(0, KV_PAD)[:, None]
    kv_ok = kh < num_kv_heads
    k_row = row + num_heads * HEAD_DIM
    k = tl.load(k_row + kh * HEAD_DIM + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
    k_rolled = tl.load(k_row + kh * HEAD_DIM + rolled[None, :], mask=kv_ok, other=0.0)
    k = (k * cos).to(kind).to(tl.float32) + (k_rolled.to(tl.float32) * sin).to(kind).to(tl.float32)
    v = tl.load(k_row + (num_kv_heads + kh) * HEAD_DIM + d[None, :], mask=kv_ok, other=0.0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    at = (slot * num_kv_heads + kh) * HEAD_DIM + d[None, :]
    k = k.to(kind).to(tl.float32)
    v = v.to(tl.float32)
    if SATURATE:
        k = tl.minimum(tl.maximum(k, -65504.0), 65504.0)
        v = tl.minimum(tl.maximum(v, -65504.0), 65504.0)
    pool = k_ptr.dtype.element_ty
    tl.store(k_ptr + at, k.to(pool), mask=kv_ok)
    tl.store(v_ptr + at, v.to(pool), mask=kv_ok)


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Rotary on q and k of qkv [T, (H_q + 2 H_kv) * D], k and v written at `slot_mapping` in
    the pool (a float16 pool under a wider model: saturated at its largest, never inf);
    returns q [T, H_q, D]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not qkv.is_contiguous() or head_dim != pow2(head_dim):
        raise ValueError("rotary_write_kv takes contiguous rows and a power-of-two head size")
    tokens = qkv.shape[0]
    q = qkv.new_empty(tokens, num_heads, head_dim)
    rotary_write_kernel[(tokens,)](
        qkv, cos.reshape(tokens, head_dim).contiguous(), sin.reshape(tokens, head_dim).contiguous(),
        slot_mapping, k_cache, v_cache, q, num_heads, num_kv_heads,
        HEAD_DIM=head_dim, HEADS_PAD=pow2(num_heads), KV_PAD=pow2(num_kv_heads),
        SATURATE=k_cache.dtype == torch.float16 and qkv.dtype != torch.float16,
    )  # fmt: skip
    return q
