"""The memory plan: how a device's memory is shared among the weights, a step's activations,
the CUDA graphs and the KV pool, decided once at start and logged in one line.

On a GPU, unless --num-blocks or --kv-cache-memory sizes the pool, the pool takes what the rest
leaves of `gpu_memory_utilization` of the GPU's total memory (vLLM's rule):

    pool = utilization * total - in use - activations - graphs

`in use` is all the GPU holds once the model is loaded (total less free: the weights, the
CUDA context, another process's memory), `activations` the peak that a
profiled step added over it: the largest step the scheduler may build (max_num_batched_tokens
prompt tokens) and a decode step of the largest graph bucket, each over a small pool of its
own, `graphs` what the decode step added (the graphs' memory pool holds about as much). A plan
whose pool would hold fewer than 2 blocks is refused at start, the plan printed, rather than
running out of memory mid-warm-up. Worked example (an H200, SmolLM2 in bfloat16, 0.9):

    total 139.8 GiB, budget 125.8 GiB; in use 0.27 GiB, activations 0.52 GiB, graphs 0.07 GiB
    -> pool 124.96 GiB: about 364,000 blocks of 16 tokens (5.8M tokens; 368,640 bytes a
       block: 30 layers x K and V x 16 tokens x 3 KV heads x 64 dims x 2 bytes)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from loom.core.step import ScheduledSequence
from loom.model.decoder import DecoderModel
from loom.model.kv_cache import KVCache, KVCacheShape

GIB = 1 << 30


@attrs.frozen(kw_only=True)
class MemoryPlan:
    device: str
    bytes_per_block: int
    block_size: int
    num_blocks: int
    in_use: int  # bytes held before the pool (a GPU's allocated, a CPU process's resident)
    activations: int = 0  # a profiled step's peak over `in_use` (a GPU's plan)
    graphs: int = 0  # the CUDA graphs' estimate
    total: int | None = None  # the device's bytes (a GPU's plan)
    budget: int | None = None  # utilization * total

    def describe(self) -> str:
        pool = self.num_blocks * self.bytes_per_block
        parts = [f"memory plan on {self.device}:"]
        if self.total is not None and self.budget is not None:
            parts.append(f"total {self.total / GIB:.2f} GiB, budget {self.budget / GIB:.2f} GiB;")
        parts.append(f"in use {self.in_use / GIB:.2f} GiB (the model loaded),")
        if self.total is not None:
            parts.append(
                f"activations {self.activations / GIB:.2f} GiB, graphs {self.graphs / GIB:.2f} GiB,"
            )
        parts.append(
            f"KV pool {pool / GIB:.2f} GiB: {self.num_blocks:,} blocks of {self.block_size} "
            f"tokens ({self.num_blocks * self.block_size:,} tokens, {self.bytes_per_block:,} "
            "bytes a block)"
        )
        return " ".join(parts)


def gpu_plan(
    *,
    device: str,
    total: int,
    free: int,
    utilization: float,
    in_use: int,
    activations: int,
    graphs: int,
    bytes_per_block: int,
    block_size: int,
) -> MemoryPlan:
    """The pool from what the budget leaves (see the top); refused (ValueError, naming the
    plan and the flags) where that is under 2 blocks."""
    budget = int(total * utilization)
    left = budget - (total - free) - activations - graphs  # at most what is free: budget <= total
    plan = MemoryPlan(
        device=device,
        bytes_per_block=bytes_per_block,
        block_size=block_size,
        num_blocks=max(0, left // bytes_per_block),
        in_use=in_use,
        activations=activations,
        graphs=graphs,
        total=total,
        budget=budget,
    )
    if plan.num_blocks < 2:
        raise ValueError(
            f"the memory plan does not fit ({plan.describe()}): the KV pool needs at least 2 "
            "blocks; raise --gpu-memory-utilization, lower --max-num-batched-tokens, or set "
            "--num-blocks or --kv-cache-memory"
        )
    return plan


def profile_gpu(
    device: torch.device, steps: Sequence[Callable[[], object]], probe_bytes: int
) -> tuple[int, int, int]:
    """(in use, activations, graphs): what is allocated before `steps` (less the probe pool
    they run over, `probe_bytes`), the highest peak any step adds over that, and the last
    step's (a decode step of the largest bucket: about what its graphs will hold)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    peaks = []
    for step in steps:
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
    torch.cuda.empty_cache()
    return base - probe_bytes, max(peaks), peaks[-1]


def profile_steps(
    forward: Callable[..., torch.Tensor],
    model: DecoderModel,
    pool: KVCache,
    tokens: int,
    rows: int,
) -> list[Callable[[], object]]:
    """The two steps profiled: `tokens` prompt tokens in one sequence (the largest step the
    scheduler builds) and `rows` decode rows, each with its logits in float32, over `pool`
    (`forward` is ModelRunner.forward, the model's: the dynamic step)."""
    block_size = pool.k[0].shape[1]
    tokens = min(tokens, model.max_model_len, (pool.num_blocks - 1) * block_size)
    table = tuple(range(1, -(-tokens // block_size) + 1))
    prompt = ScheduledSequence(
        request_id="profile", token_ids=(0,) * tokens, num_computed_tokens=0, block_table=table
    )
    decodes = [
        ScheduledSequence(
            request_id=str(i), token_ids=(0,), num_computed_tokens=0, block_table=(1,)
        )
        for i in range(rows)
    ]

    def run(sequences: list[ScheduledSequence], last: int) -> None:
        hidden = forward(sequences, kv_cache=pool)
        model.compute_logits(hidden[-last:]).float()

    return [lambda: run([prompt], 1), lambda: run(decodes, rows)]


def profiled_plan(
    forward: Callable[..., torch.Tensor],
    model: DecoderModel,
    shape: KVCacheShape,
    pools: int,
    max_step_tokens: int,
    max_rows: int,
    *,
    utilization: float,
) -> MemoryPlan:
    """A GPU's plan: the steps profiled over a probe pool of their own (a prompt chunk of
    `max_step_tokens`, a decode step of `max_rows`; freed after), then what `utilization` of
    the GPU leaves for `pools` pools of `shape`."""
    device = model.device
    probe_blocks = -(-max_step_tokens // shape.block_size) + 2
    probe = KVCache.allocate(shape, probe_blocks, device)
    steps = profile_steps(forward, model, probe, max_step_tokens, max_rows)
    in_use, activations, graphs = profile_gpu(device, steps, probe_blocks * shape.bytes_per_block)
    del probe, steps
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return gpu_plan(
        device=str(device),
        total=total,
        free=free,
        utilization=utilization,
        in_use=in_use,
        activations=activations,
        graphs=graphs,
        bytes_per_block=pools * shape.bytes_per_block,
        block_size=shape.block_size,
    )
