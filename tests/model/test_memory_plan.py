"""The memory plan (loom/model/memory_plan.py): a GPU's pool from what the budget leaves, its
worked example, refused with the plan printed where it does not fit, never past what is free;
the profiled steps run over their own pool (here on the CPU: the same code a GPU profiles);
the runner logs its plan."""

from __future__ import annotations

import logging

import pytest
import torch

from loom.core.config import CacheConfig
from loom.model.kv_cache import KVCache
from loom.model.memory_plan import GIB, MemoryPlan, gpu_plan, profile_steps
from loom.model.model_runner import ModelRunner
from tests.conftest import tiny_model

PER_BLOCK = 368_640  # SmolLM2's in bf16: 30 layers x K and V x 16 tokens x 3 heads x 64 x 2 B


def plan(**changes: float) -> MemoryPlan:
    settings = {
        "device": "cuda:0",
        "total": int(139.8 * GIB),
        "free": int(139.5 * GIB),
        "utilization": 0.9,
        "in_use": int(0.27 * GIB),
        "activations": int(0.52 * GIB),
        "graphs": int(0.07 * GIB),
        "bytes_per_block": PER_BLOCK,
        "block_size": 16,
    }
    return gpu_plan(**{**settings, **changes})  # type: ignore[arg-type]


def test_memory_plan_pool_is_what_the_budget_leaves() -> None:
    """The worked example: 0.9 of 139.8 GiB, less what is in use (0.3 GiB: 139.8 - 139.5),
    the activations and the graphs."""
    result = plan()
    left = int(139.8 * GIB * 0.9) - int(0.3 * GIB + 1) - int(0.52 * GIB) - int(0.07 * GIB)
    assert abs(result.num_blocks - left // PER_BLOCK) <= 1
    line = result.describe()
    assert "total 139.80 GiB, budget 125.82 GiB" in line
    assert "activations 0.52 GiB, graphs 0.07 GiB" in line
    assert "blocks of 16 tokens" in line


def test_memory_plan_counts_another_process_s_memory_against_the_budget() -> None:
    """Another process holds 39.5 GiB of the GPU: the budget is the same, less all of it."""
    result = plan(free=int(100 * GIB))
    used = int(139.8 * GIB) - int(100 * GIB)
    left = int(139.8 * GIB * 0.9) - used - int(0.52 * GIB) - int(0.07 * GIB)
    assert result.num_blocks == left // PER_BLOCK


def test_memory_plan_that_does_not_fit_is_refused_with_the_plan() -> None:
    with pytest.raises(
        ValueError, match=r"does not fit .*total 139.80 GiB.*--gpu-memory-utilization"
    ):
        plan(utilization=0.004)
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        plan(activations=int(139 * GIB))


def test_memory_plan_profiled_steps_run_over_their_own_pool() -> None:
    """The two steps a GPU profiles (the largest prompt chunk, the largest decode bucket) run
    here too, over a probe pool of their own, and write nothing else."""
    loaded = tiny_model("llama")
    runner = ModelRunner(loaded, CacheConfig(num_blocks=8, block_size=16))
    before = [layer.clone() for layer in runner.kv_cache.k]
    probe = KVCache.allocate(runner.kv_cache_shape, 6, runner.device)
    steps = profile_steps(runner.forward, runner.model, probe, 64, 8)
    for step in steps:
        step()
    assert probe.k[0][1:5].abs().sum() > 0  # the 64-token prompt: blocks 1 to 4
    assert all(map(torch.equal, before, runner.kv_cache.k))


def test_memory_plan_runner_logs_its_plan(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="loom.model.model_runner"):
        runner = ModelRunner(tiny_model("llama"), CacheConfig(num_blocks=9, block_size=16))
    assert runner.plan.num_blocks == 9
    assert runner.plan.in_use > 50 << 20  # the process: torch and the model at least
    assert "memory plan on cpu: in use" in caplog.text
    assert "KV pool" in caplog.text
    assert "9 blocks of 16 tokens (144 tokens" in caplog.text
