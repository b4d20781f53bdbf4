"""Sliding windows in the paged KV cache, through the engine (loom/core/block_manager.py,
`slide`): a windowed model's blocks held stay bounded by its window however long it generates,
and its tokens stay transformers' `generate` tokens under chunked prefill, preemption and
prefix-cache hits (a hit never relies on a block that was released); and a generation config's
several EOS ids each stop a request.

The models: test_families' cases whose every layer slides a window of 12 (a model with a global
layer, Gemma's or Qwen2's with `max_window_layers`, keeps every block).
"""

from __future__ import annotations

import pytest
import trio

from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.request_output import FinishReason
from loom.core.sampling_params import SamplingParams
from tests.engine.test_engine import collect, run_against_reference, serving, tokens_of
from tests.engine.test_prefix_caching import run_shared_prefixes
from tests.model.test_families import WINDOW, case_model
from tests.support.greedy import reference_tokens

SLIDING = ("mistral-window", "phi3-partial-window", "qwen3-window-bias", "qwen2-moe-norm-window")
BLOCK = 4


async def test_sliding_window_blocks_held_stay_bounded_as_generation_goes_on() -> None:
    """200 tokens after a 20-token prompt: the request holds at most window / block_size + 2
    blocks at every output (55 blocks without sliding), and its tokens are `generate`'s."""
    loaded = case_model("mistral-window")
    prompt = list(range(3, 23))
    expected = reference_tokens(loaded.model, prompt, 200)
    held, tokens = [], []
    async with serving(loaded, cache=CacheConfig(block_size=BLOCK, num_blocks=128)) as engine:
        sampling = SamplingParams(temperature=0, max_tokens=200)
        with trio.fail_after(120):
            async with engine.generate(prompt, sampling) as outputs:
                async for output in outputs:
                    tokens += output.token_ids
                    stats = engine.stats()
                    held.append(stats.num_total_blocks - stats.num_free_blocks)
    unslid = -(-(len(prompt) + 200) // BLOCK)
    print(f"sliding window {WINDOW}, blocks of {BLOCK}: at most {max(held)} blocks held over 200 "
          f"tokens (without sliding: {unslid})")  # fmt: skip
    assert tokens == expected
    assert max(held) <= WINDOW // BLOCK + 2


@pytest.mark.parametrize("name", SLIDING)
async def test_sliding_window_matches_generate_under_preemption_and_chunked_prefill(
    name: str,
) -> None:
    engine = await run_against_reference(
        case_model(name),
        cache=CacheConfig(block_size=BLOCK, num_blocks=17),  # 64 slots for 16 requests of up to 64
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=16),
    )
    stats = engine.stats()
    print(f"{name}: {stats.num_preemptions} preemptions, {stats.num_chunked_prefills} chunks")
    assert stats.num_preemptions > 0
    assert stats.num_chunked_prefills > 0


@pytest.mark.parametrize("name", SLIDING[:2])
async def test_sliding_window_prefix_cache_hits_keep_generate_tokens(name: str) -> None:
    """Prompts over one 40-token text, one after another, then all at once in a pool too small
    to keep everything cached: hits of up to 32 tokens (past the window: blocks slid out and
    released stay cached while they last), every request's tokens as `generate`'s."""
    stats, cached = await run_shared_prefixes(
        case_model(name),
        concurrent=True,
        cache=CacheConfig(block_size=BLOCK, num_blocks=24),
        scheduler=SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=9),
    )
    assert max(cached) > WINDOW  # the first pass, one request at a time: deterministic
    assert stats.prefix_cache_hits >= sum(cached)  # a preempted request may hit again


async def test_generation_stops_on_every_eos_id_the_config_lists() -> None:
    """Gemma 3 and Llama 3 list several EOS ids in their generation config: a request stops on
    whichever comes first, as `generate` with the same config does."""
    loaded = case_model("gemma3")
    prompt = list(range(3, 23))
    free_run = reference_tokens(loaded.model, prompt, 12)
    later, first = free_run[8], free_run[4]  # two ids `generate` would give, the later one first
    loaded.model.generation_config.eos_token_id = [later, first]
    expected = reference_tokens(loaded.model, prompt, 12)
    assert len(expected) == free_run.index(first) + 1  # generate stops at the first of them
    async with serving(loaded) as engine:
        with trio.fail_after(60):
            outputs = await collect(engine, prompt, SamplingParams(temperature=0, max_tokens=12))
    assert tokens_of(outputs) == expected
    assert outputs[-1].finish_reason is FinishReason.STOP
