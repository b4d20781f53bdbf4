"""The small operations fused in Triton (loom/model/triton_ops.py) against the torch ops they
replace in loom/model/decoder.py, under TRITON_INTERPRET=1 on the CPU (set by tests/conftest.py;
float32 and float16: the interpreter has no bfloat16 arithmetic), compiled with
LOOM_TEST_DEVICE=cuda; and a decoder whose small ops are these, step for step the unfused one's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from loom.core.block_manager import BlockManager
from loom.core.config import CacheConfig
from loom.core.step import ScheduledSequence
from loom.model.attention import write_kv
from loom.model.decoder_layer import rms_norm
from loom.model.model_runner import ModelRunner
from tests.conftest import tiny_model
from tests.support.greedy import GreedyRequest, reference_tokens, run_greedy
from tests.support.placement import DEVICE, ON_GPU

pytest.importorskip("triton")
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it
    pytest.fail("the Triton kernels need TRITON_INTERPRET=1 on the CPU")

from loom.model import triton_ops

DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 576])  # 576: SmolLM2's, padded to 1024 lanes
def test_triton_add_rms_norm_adds_in_place_and_normalises(dtype: torch.dtype, width: int) -> None:
    x, delta = randn(5, width, dtype=dtype, seed=1), randn(5, width, dtype=dtype, seed=2)
    weight = randn(width, dtype=dtype, seed=3)
    expected_sum = x + delta
    expected = rms_norm(expected_sum, weight, 1e-5)
    out = triton_ops.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, expected_sum)  # the residual stream, in place
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    alone = triton_ops.add_rms_norm(x, None, weight, 1e-5)
    torch.testing.assert_close(alone, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_silu_mul_is_silu_times_up(dtype: torch.dtype) -> None:
    gate_up = randn(7, 2 * 1536, dtype=dtype, seed=4)  # two column blocks of 1024
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = triton_ops.silu_mul(gate_up)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def torch_rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """loom/model/decoder.py's rotary_write_kv arithmetic: q, k rotated; v."""
    tokens, d = qkv.shape[0], cos.shape[-1]
    qk = qkv[:, : (num_heads + num_kv_heads) * d].view(tokens, -1, d)
    qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
    v = qkv[:, (num_heads + num_kv_heads) * d :].view(tokens, num_kv_heads, d)
    return qk[:, :num_heads], qk[:, num_heads:], v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (9, 3)])  # 9: padded to 16
def test_triton_rotary_write_kv_rotates_and_writes_the_slots(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int
) -> None:
    tokens, d, num_blocks, block_size = 6, 64, 8, 4
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * d, dtype=dtype, seed=5)
    angles = randn(tokens, 1, d, dtype=torch.float32, seed=6)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([5, 9, 0 + 12, 30, 31, 2], device=DEVICE)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = triton_ops.rotary_write_kv(qkv, cos, sin, slots, k_cache, v_cache, num_heads)
    eq, ek, ev = torch_rotary(qkv, cos, sin, num_heads, num_kv_heads)
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_kv(expected_k, expected_v, ek, ev, slots)
    tolerance = {"rtol": TOLERANCE[dtype], "atol": TOLERANCE[dtype]}
    torch.testing.assert_close(q, eq, **tolerance)
    torch.testing.assert_close(k_cache, expected_k, **tolerance)
    assert torch.equal(v_cache, expected_v)  # copied as they are


def test_triton_rotary_write_kv_saturates_a_float16_pool() -> None:
    tokens, d = 2, 64
    qkv = 1e6 * randn(tokens, 3 * d, dtype=torch.float32, seed=7)
    ones = torch.ones(tokens, 1, d, device=DEVICE)
    k_cache = torch.zeros(2, 4, 1, d, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([1, 2], device=DEVICE)
    triton_ops.rotary_write_kv(qkv, ones, 0 * ones, slots, k_cache, v_cache, 1)
    assert bool(torch.isfinite(k_cache).all())
    assert bool(torch.isfinite(v_cache).all())
    assert float(v_cache.float().abs().max()) == 65504.0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_ops_in_the_decoder_give_generate_s_greedy_tokens(family: str) -> None:
    """A decoder whose small ops are Triton's (as on a GPU), here under the interpreter: whole
    requests, prompts and decode steps, give transformers' greedy tokens, and each step's
    logits are the CPU kernels' within rounding."""
    loaded = tiny_model(family)
    runner = ModelRunner(loaded, CacheConfig(num_blocks=64, block_size=4))
    assert runner.model.fused
    assert runner.model.fused_rotary
    runner.model.ops = triton_ops
    prompts = [[3, 1, 4, 1, 5], list(range(20, 37))]
    requests = [GreedyRequest(str(i), p, 8) for i, p in enumerate(prompts)]
    run_greedy(runner, BlockManager(num_blocks=64, block_size=4), requests)
    assert [r.output for r in requests] == [reference_tokens(loaded.model, p, 8) for p in prompts]
    reference = ModelRunner(loaded, CacheConfig(num_blocks=64, block_size=4))
    step = ScheduledSequence(
        request_id="a",
        token_ids=tuple(prompts[1]),
        num_computed_tokens=0,
        block_table=(1, 2, 3, 4, 5),
    )
    torch.testing.assert_close(runner.logits(step), reference.logits(step), rtol=1e-4, atol=1e-4)
