"""The core's settings: the KV cache's shape and size, and the scheduler's limits per step."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from loom.core.setting import at_least, byte_size, in_range, setting
from loom.core.speculative import SpeculativeConfig


@attrs.frozen(kw_only=True)
class CacheConfig:
    """The KV pool. Its size is the first of these that is set: `num_blocks`, then
    `kv_cache_memory` bytes, then on a GPU what `gpu_memory_utilization` of its memory leaves
    (loom/model/memory_plan.py), on a CPU `kv_cache_memory_fraction` of its free memory."""

    block_size: int = setting(16, "tokens per KV block", check=at_least(1))
    num_blocks: int | None = setting(
        None,
        "KV pool size in blocks, the null block included (overrides the memory settings)",
        check=at_least(2),
    )
    kv_cache_memory: int | None = setting(
        None,
        "KV pool size in bytes, e.g. 2GiB (overrides --kv-cache-memory-fraction)",
        check=at_least(1),
        parse=byte_size,
    )
    kv_cache_memory_fraction: float = setting(
        0.1,
        "KV pool as a fraction of the device's free memory",
        check=in_range(0, 1, low_open=True),
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "on a GPU, the fraction of its memory Loom may use: the KV pool takes what the weights, "
        "a profiled step's activations and the CUDA graphs leave of it (unless --num-blocks or "
        "--kv-cache-memory)",
        check=in_range(0, 1, low_open=True),
    )
    kv_cache_dtype: str = setting(
        "auto",
        "the KV pool's dtype: auto (the model's), or float16 (fp16) for half the bytes a token "
        "(keys and values rounded to it as they are written)",
        choices=("auto", "float32", "fp32", "float16", "fp16", "bfloat16", "bf16"),
    )
    enable_prefix_caching: bool = setting(
        True, "reuse the KV blocks of prompt prefixes computed before (full blocks, LRU-evicted)"
    )

    def num_blocks_for(self, bytes_per_block: int, free_memory: Callable[[], int]) -> int:
        """The pool size in blocks; `free_memory()` (bytes) is asked only when the fraction
        decides."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_memory is not None:
            budget, source = self.kv_cache_memory, "kv_cache_memory"
        else:
            budget = int(free_memory() * self.kv_cache_memory_fraction)
            source = f"kv_cache_memory_fraction={self.kv_cache_memory_fraction} of free memory"
        num_blocks = budget // bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"{source}: {budget} bytes hold {num_blocks} KV blocks of {bytes_per_block} "
                "bytes; at least 2 are needed (one is the null block)"
            )
        return num_blocks


# A GPU's step limits where no flag sets them (vLLM's): a decode step of 256 sequences costs a
# GPU little more than one of 64, and a prompt chunk of 8192 tokens little more than one of 512.
GPU_MAX_NUM_SEQS = 256
GPU_MAX_NUM_BATCHED_TOKENS = 8192


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = setting(
        64, "most sequences in one step (a GPU's default: 256)", check=at_least(1)
    )
    max_num_batched_tokens: int = setting(
        512, "most tokens in one step (a GPU's default: 8192)", check=at_least(1)
    )

    def on_gpu(self, given: set[str]) -> SchedulerConfig:
        """These limits for a GPU: the GPU's default for each one not `given` (by a flag)."""
        return attrs.evolve(
            self,
            max_num_seqs=self.max_num_seqs if "max_num_seqs" in given else GPU_MAX_NUM_SEQS,
            max_num_batched_tokens=self.max_num_batched_tokens
            if "max_num_batched_tokens" in given
            else GPU_MAX_NUM_BATCHED_TOKENS,
        )

    scheduling_policy: str = setting(
        "fair",
        "fair: tenants share by weight (loom/core/fair_share.py), each one's requests by "
        "priority, then arrival; priority: by priority, then arrival; fcfs: by arrival",
        choices=("fair", "priority", "fcfs"),
    )
    step_mask_budget: float = setting(
        0.01,
        "seconds of token-mask building one step takes on (constrained rows' CPU time, each "
        "as its last mask took); rows past it wait for a later step, the least served "
        "tenant's first; one always runs",
        check=in_range(0, 60, low_open=True),
    )
    async_scheduling: bool | None = setting(
        None,
        "overlap steps (vLLM's async scheduling): step N + 1 is scheduled and launched before "
        "step N's tokens are applied, which happens while N + 1 runs; a request that step N "
        "finishes computes one token more, never emitted. Off under speculative decoding. "
        "Unset: on where a step leaves the CPU's cores free (a GPU, the simulated model), off "
        "where the model computes on them",
    )
    speculative: SpeculativeConfig = attrs.field(factory=SpeculativeConfig)


@attrs.frozen(kw_only=True)
class ConstraintConfig:
    """Limits on structured outputs' constraints (loom/core/constraint.py)."""

    max_constraint_bytes: int = setting(
        65536,
        "largest JSON schema, regex, grammar or list of choices, in bytes; beyond it "
        "INVALID_ARGUMENT",
        check=at_least(1),
    )
    constraint_compile_timeout: float = setting(
        2.0,
        "seconds a constraint may take to compile, from when its compile begins (not its "
        "wait for a thread); beyond it INVALID_ARGUMENT, and the tenant's next request for "
        "it too",
        check=in_range(0, 60, low_open=True),
    )
    constraint_mask_timeout: float = setting(
        0.25,
        "seconds a constraint's first token mask may take, built as it compiles (every "
        "request's copy starts from it); beyond it INVALID_ARGUMENT",
        check=in_range(0, 60, low_open=True),
    )
    constraint_step_items: int = setting(
        4000,
        "Earley items one token may add to a constraint's parser (llguidance's "
        "step_max_items, 50,000 by default); beyond it the request ends with the "
        "constraint's error (at its first mask: INVALID_ARGUMENT). A token's consume holds "
        "the GIL, every thread of the server waiting, for a time that grows as the square "
        "of its items: some 6 ms at this default on a 2-core Zen 4, 250 ms at 32,000",
        check=at_least(100),
    )
    constraint_cache_size: int = setting(
        256,
        "compiled constraints kept, each by tenant, cache_salt and content (no tenant's "
        "request is faster for another's), most recently used first",
        check=at_least(1),
    )
    compile_threads: int = setting(
        2,
        "constraints compiling at once; a tenant's compiles run one at a time while another "
        "tenant's wait, so no tenant holds every thread",
        check=at_least(1),
    )
    max_pending_compiles: int = setting(
        4,
        "distinct constraints one tenant may have compiling or waiting to compile (copies of "
        "one, and a request's choices, share its compile); beyond it RESOURCE_EXHAUSTED",
        check=at_least(1),
    )
