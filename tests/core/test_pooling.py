"""Embedding requests in the scheduler: what each step pools, chunk by chunk and after a
preemption, when the request ends (its prompt pooled, nothing sampled), its vector, and what
it takes from the prefix cache (last-token pooling may; mean pooling reads every position)."""

from __future__ import annotations

import math

import pytest

from loom.core.pooling import Pooling, PoolRows, embedding
from loom.core.request import RequestStatus
from loom.core.sampling_params import SamplingParams
from loom.core.step import ModelRunnerOutput, SchedulerOutput
from tests.core.test_scheduler import make_scheduler
from tests.support.factory import make_request

MEAN = Pooling(kind="mean", normalize=False)
LAST = Pooling(kind="last", normalize=True)


def pooled(output: SchedulerOutput) -> ModelRunnerOutput:
    """Each pooling sequence's rows as the runner would pool them if every position's hidden
    state were (position, 1.0): a mean's sum of its rows, or the last row."""
    values = {}
    for seq in output.sequences:
        rows = seq.pooling
        if rows is not None:
            start = seq.num_computed_tokens + rows.first_row
            end = seq.num_computed_tokens + len(seq.token_ids) if rows.mean else start + 1
            values[seq.request_id] = (float(sum(range(start, end))), float(end - start))
    return ModelRunnerOutput(request_ids=(), token_ids=(), logprobs=(), pooled=values)


def test_mean_pooling_sums_each_chunk_once_even_after_a_preemption() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("e", num_prompt=10, sampling=SamplingParams(pooling=MEAN))
    scheduler.add_request(request)
    first = scheduler.schedule(now=0.0)
    assert first is not None
    (seq,) = first.sequences
    assert (seq.sampling, seq.pooling) == (None, PoolRows(first_row=0, mean=True))
    assert scheduler.update(first, pooled(first), now=0.0) == []
    scheduler.preempt(request)  # its K/V gone: positions 0-3 computed again, not pooled again
    outputs = []
    while not request.finished:
        output = scheduler.schedule(now=0.0)
        assert output is not None
        outputs += scheduler.update(output, pooled(output), now=0.0)
        assert all(s.sampling is None for s in output.sequences)
    ((_, final),) = outputs
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert final.embedding == (sum(range(10)) / 10, 1.0)  # each position counted once
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (10, 0)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks - 1


@pytest.mark.parametrize("pooling", [LAST, MEAN])
def test_last_token_pooling_takes_cached_blocks_mean_pooling_none(pooling: Pooling) -> None:
    scheduler = make_scheduler(caching=True)
    for name in ("a", "b"):
        request = make_request(name, num_prompt=9, sampling=SamplingParams(pooling=pooling))
        scheduler.add_request(request)
        output = scheduler.schedule(now=0.0)
        assert output is not None
        (seq,) = output.sequences
        ((_, final),) = scheduler.update(output, pooled(output), now=0.0)
    assert request.num_cached_tokens == (8 if pooling is LAST else 0)
    if pooling is LAST:  # the last position alone, computed whatever the cache held
        assert seq.pooling == PoolRows(first_row=0, mean=False)
        assert final.embedding == (8 / math.hypot(8, 1), 1 / math.hypot(8, 1))


def test_an_embedding_is_cut_then_normalised() -> None:
    vector = embedding([3.0, 4.0, 12.0], 1, Pooling(kind="last", dimensions=2, normalize=True))
    assert vector == (0.6, 0.8)
    assert embedding([2.0, 4.0], 2, Pooling(kind="mean", normalize=False)) == (1.0, 2.0)
