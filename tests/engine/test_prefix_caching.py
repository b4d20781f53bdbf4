"""Prefix caching in the trio engine with tiny random-weight models: the exact path's tokens stay
transformers' `generate` tokens whatever a request finds in the cache, and the blocks' books
stay balanced."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.request_output import RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.model.loader import LoadedModel
from tests.conftest import tiny_model
from tests.engine.test_engine import assert_idle, collect, serving, tokens_of
from tests.support.greedy import reference_tokens

BLOCK = 4


def shared_prefix_prompts(rng: random.Random) -> list[list[int]]:
    """Prompts over one 40-token text: sharing 1 block up to the whole prompt, ending on a block
    boundary or inside a block, and the same prompt twice."""
    base = [rng.randrange(512) for _ in range(40)]
    # The whole prompt cached; ending on a boundary; one token past a boundary, so that the
    # only token computed goes through the decode path.
    prompts = [base[:24], base[:24], base[:16], base, [*base[:24], 7]]
    for shared in (4, 8, 13, 20, 32):  # 1 block, 2, 3 and a part, 5, 8
        tail = [rng.randrange(512) for _ in range(rng.randint(1, 9))]
        prompts.append(base[:shared] + tail)
    return prompts


async def run_shared_prefixes(loaded: LoadedModel, *, concurrent: bool, **config: Any) -> Any:
    """The prompts one after another (each may hit what the earlier ones left), then with
    `concurrent` all at once again; every request checked against `generate` on its full prompt.
    Returns the engine's stats and each request's cached tokens, in order."""
    prompts = shared_prefix_prompts(random.Random(3))
    max_tokens = [6 + i % 5 for i in range(len(prompts))]
    expected = [
        reference_tokens(loaded.model, p, n) for p, n in zip(prompts, max_tokens, strict=True)
    ]
    cached: list[int] = []
    async with serving(loaded, **config) as engine:

        async def one(i: int, into: dict[int, list[RequestOutput]]) -> None:
            sampling = SamplingParams(temperature=0, max_tokens=max_tokens[i])
            into[i] = await collect(engine, prompts[i], sampling)

        everyone = list(range(len(prompts)))
        passes = [[[i] for i in everyone]] + ([[everyone]] if concurrent else [])
        with trio.fail_after(120):
            for waves in passes:
                got: dict[int, list[RequestOutput]] = {}
                for wave in waves:
                    async with trio.open_nursery() as nursery:
                        for i in wave:
                            nursery.start_soon(one, i, got)
                for i in everyone:
                    assert tokens_of(got[i]) == expected[i], f"prompt {i}"
                    usage = got[i][-1].usage
                    assert usage is not None
                    cached.append(usage.cached_tokens)
        await trio.sleep(0.01)
        assert_idle(engine)
        return engine.stats(), cached


@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_prefix_caching_hits_keep_generate_tokens_one_after_another(family: str) -> None:
    stats, cached = await run_shared_prefixes(
        tiny_model(family), concurrent=False, cache=CacheConfig(block_size=BLOCK, num_blocks=256)
    )
    # The second prompt is the first again: all its whole blocks but the one holding its last
    # token (24 tokens: 5 blocks); the third (16 tokens) ends on a boundary: 3 blocks; the
    # fifth computes 1 token of its 25.
    assert cached[:5] == [0, 20, 12, 24, 24]
    assert cached[5:] == [4, 8, 12, 20, 32]
    assert stats.prefix_cache_hits == sum(cached)
    assert stats.num_cached_blocks > 0


async def test_prefix_caching_hits_keep_generate_tokens_under_chunking_and_preemption() -> None:
    stats, cached = await run_shared_prefixes(
        tiny_model("llama"),
        concurrent=True,
        cache=CacheConfig(block_size=BLOCK, num_blocks=20),  # 76 slots for 9 requests of ~50
        scheduler=SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=9),
    )
    assert stats.num_preemptions > 0
    assert stats.num_chunked_prefills > 0
    num_prompts = len(cached) // 2
    assert sum(cached[num_prompts:]) > 0  # hits in the concurrent pass, the one that preempts
