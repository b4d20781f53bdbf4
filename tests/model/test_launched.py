"""Overlapped steps through the real scheduler and a tiny model: step N + 1 launched before step
N's result is applied, its pending tokens taken from N's sampled ids where the runner left them
(loom/model/launched.py), give the serial loop's tokens; in fp32 greedy, `generate`'s."""

from __future__ import annotations

import random

import pytest

from loom.core.block_manager import BlockManager
from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.overlap import step_runs_ahead
from loom.core.request import Request
from loom.core.sampling_params import SamplingParams
from loom.core.scheduler import Scheduler
from loom.core.step import PLACEHOLDER, SchedulerOutput
from loom.model import kernels
from loom.model.launched import Launched, SampledTokens
from loom.model.model_runner import ModelRunner
from tests.conftest import tiny_model
from tests.support.greedy import reference_tokens
from tests.support.placement import ON_GPU

BLOCK_SIZE = 4


def requests(sampled: bool) -> list[Request]:
    """Twelve requests of random prompts: greedy, or (`sampled`) every third one seeded at
    temperature 0.8 and every fourth with logprobs."""
    rng = random.Random(3)
    found = []
    for i in range(12):
        params = SamplingParams(temperature=0, max_tokens=rng.randint(3, 14))
        if sampled and i % 3 == 0:
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=params.max_tokens)
        if sampled and i % 4 == 1:
            params = SamplingParams(temperature=0, logprobs=2, max_tokens=params.max_tokens)
        prompt = tuple(rng.randrange(1, 512) for _ in range(rng.randint(1, 19)))
        found.append(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling=params,
                max_tokens=params.max_tokens or 0,
                eos_token_ids=(),
                arrival_time=0.0,
            )
        )
    return found


def drive(runner: ModelRunner, ahead: bool, sampled: bool) -> tuple[dict[str, list[int]], int]:
    """Every request to its end, as the engine's loop steps them: each step launched, then
    the step before it applied; one step ahead where `ahead` and the scheduler allow. The
    tokens of each request, and how many steps held a pending token."""
    blocks = BlockManager(num_blocks=16, block_size=BLOCK_SIZE)  # a few preemptions
    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8, async_scheduling=ahead)
    scheduler = Scheduler(config, blocks)
    pending = requests(sampled)
    for request in pending:
        scheduler.add_request(request)
    flight: tuple[SchedulerOutput, Launched] | None = None
    num_pending = 0
    while scheduler.has_unfinished() or flight is not None:
        output = None
        if flight is None or step_runs_ahead(config, scheduler.requests, flight[0]):
            output = scheduler.schedule(now=0.0)
        launched = runner.launch(output) if output is not None else None
        if output is not None:
            num_pending += any(s.pending_token for s in output.sequences)
        if flight is not None:
            scheduler.update(flight[0], flight[1].output(), now=0.0)
        flight = (output, launched) if output is not None and launched is not None else None
    assert blocks.num_free_blocks == blocks.num_total_blocks
    assert scheduler.num_preemptions > 0
    return {r.request_id: r.output_token_ids for r in pending}, num_pending


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_launched_steps_ahead_give_the_serial_loop_s_tokens(static: bool, sampled: bool) -> None:
    if static and not ON_GPU and kernels.unavailable() is not None:
        pytest.skip(f"Loom's CPU kernels: {kernels.unavailable()}")
    loaded = tiny_model("llama")
    cache = CacheConfig(num_blocks=16, block_size=BLOCK_SIZE)
    serial, _ = drive(ModelRunner(loaded, cache, static_decode=static), False, sampled)
    overlapped, num_pending = drive(ModelRunner(loaded, cache, static_decode=static), True, sampled)
    assert num_pending > 10  # (the steps did run ahead)
    assert overlapped == serial
    if not sampled:
        for request in requests(sampled):
            prompt = list(request.prompt_token_ids)
            expected = reference_tokens(loaded.model, prompt, request.max_tokens)
            assert serial[request.request_id] == expected


def test_sampled_tokens_refuse_a_pending_token_the_last_step_did_not_sample() -> None:
    scheduler = Scheduler(SchedulerConfig(), BlockManager(num_blocks=8, block_size=BLOCK_SIZE))
    scheduler.add_request(
        Request(
            request_id="a",
            prompt_token_ids=(1, 2),
            sampling=SamplingParams(temperature=0, max_tokens=5),
            max_tokens=5,
            eos_token_ids=(),
            arrival_time=0.0,
        )
    )
    scheduler.schedule(now=0.0)
    ahead = scheduler.schedule(now=0.0)
    assert ahead is not None
    assert ahead.sequences[0].token_ids == (PLACEHOLDER,)
    with pytest.raises(ValueError, match="request a: no token of the last step"):
        SampledTokens.none().sources(ahead.sequences)
