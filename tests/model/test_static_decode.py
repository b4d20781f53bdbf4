"""The static decode step (loom/model/static_decode.py) run eagerly on the CPU, as a GPU
replays it from its CUDA graphs: the same hidden states and the same K/V pool as the dynamic
step, padded rows writing only the scratch block; the greedy tokens of transformers' `generate`
through whole requests; no op in the step that makes the host wait for the device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch

from loom.core.block_manager import BlockManager
from loom.core.config import CacheConfig
from loom.core.sampling_params import SamplingParams
from loom.core.step import SamplingInput, ScheduledSequence, SchedulerOutput
from loom.model import kernels
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner
from loom.model.static_decode import StaticDecode
from tests.conftest import tiny_model
from tests.support.greedy import GreedyRequest, reference_tokens, run_greedy
from tests.support.placement import ON_GPU
from tests.support.sync_audit import SyncAudit

pytestmark = pytest.mark.skipif(
    not ON_GPU and kernels.unavailable() is not None,
    reason=f"Loom's CPU kernels: {kernels.unavailable()}",
)
Prompt = Callable[[int, int], list[int]]
BLOCK_SIZE = 4
NUM_BLOCKS = 64


def runners(loaded: LoadedModel) -> tuple[ModelRunner, ModelRunner]:
    """The dynamic runner and the static one, over pools of the same random pages."""
    cache = CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    dynamic = ModelRunner(loaded, cache, static_decode=False)
    static = ModelRunner(loaded, cache, static_decode=True)
    assert dynamic.static is None
    assert static.static is not None
    assert static.num_blocks == dynamic.num_blocks == NUM_BLOCKS  # the scratch block is apart
    for mine, theirs in zip(
        dynamic.kv_cache.k + dynamic.kv_cache.v, static.kv_cache.k + static.kv_cache.v, strict=True
    ):
        mine[1:].normal_()  # written pages; block 0, the null block, stays zeros
        theirs[:NUM_BLOCKS].copy_(mine)
        theirs[NUM_BLOCKS:].fill_(float("nan"))  # the scratch block: never read
    return dynamic, static


def decode_step(contexts: list[int]) -> list[ScheduledSequence]:
    """Sequence i decodes token 7 + i over contexts[i] cached tokens, its blocks shuffled."""
    generator = torch.Generator().manual_seed(sum(contexts))
    blocks = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    sequences = []
    for i, context in enumerate(contexts):
        used = context // BLOCK_SIZE + 1
        table, blocks = tuple(blocks[:used]), blocks[used:]
        sequences.append(
            ScheduledSequence(
                request_id=str(i),
                token_ids=(7 + i,),
                num_computed_tokens=context,
                block_table=table,
            )
        )
    return sequences


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit for bit on the CPU (one kernel either way); on a GPU within rounding: the Triton
    kernel splits a row's keys by the step's row count, the bucket's or the batch's."""
    if ON_GPU:
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    else:
        assert torch.equal(a, b)


def pools(runner: ModelRunner) -> list[torch.Tensor]:
    return [layer[:NUM_BLOCKS] for layer in runner.kv_cache.k + runner.kv_cache.v]


@pytest.mark.parametrize(
    ("family", "config"),
    [("llama", {}), ("qwen3", {}), ("gemma2", {"sliding_window": 6, "head_dim": 16}), ("phi3", {})],
)
@pytest.mark.parametrize("contexts", [[0], [5, 17, 3], [9, 0, 30, 12, 4]])  # padded to 1, 4, 8
def test_static_decode_equals_the_dynamic_step_with_padded_rows(
    family: str, config: dict[str, Any], contexts: list[int]
) -> None:
    """Hidden states and the whole pool, bit for bit; the padded rows' K/V in the scratch
    block alone (block 0 still zeros). Gemma 2: windows and soft caps; Qwen3: q/k norms; Phi-3:
    partial rotary (the torch rotary path, not the fused one)."""
    dynamic, static = runners(tiny_model(family, **config))
    sequences = decode_step(contexts)
    expected = dynamic.forward(sequences)
    assert static.static is not None
    assert static.static.bucket(len(contexts)) > len(contexts) or len(contexts) == 1
    out = static.forward(sequences)
    same(out, expected)
    for mine, theirs in zip(pools(static), pools(dynamic), strict=True):
        same(mine, theirs)
    assert all(layer[0].eq(0).all() for layer in pools(static))
    padded = static.static.bucket(len(contexts)) - len(contexts)
    scratch = static.kv_cache.k[0][NUM_BLOCKS, 0]  # the scratch slot's keys
    assert scratch.isnan().any() == (padded == 0)  # written by the padded rows, only


def test_static_decode_samples_as_the_dynamic_step_through_the_runner() -> None:
    """Through execute_model (the LM head and the sampler after the step): the same tokens,
    seeded random rows among them, and the same log-probabilities."""
    dynamic, static = runners(tiny_model("llama"))
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.8, seed=5, logprobs=3),
        SamplingParams(temperature=1.0, top_k=20, seed=9, logprobs=3),
    ]
    sequences = [
        attrs.evolve(seq, sampling=SamplingInput(params=p, num_output_tokens=0, eos_token_ids=()))
        for seq, p in zip(decode_step([3, 40, 11]), params, strict=True)
    ]
    step = SchedulerOutput(sequences=tuple(sequences))
    expected = dynamic.execute_model(step)
    result = static.execute_model(step)
    assert result.token_ids == expected.token_ids
    assert ON_GPU or result == expected  # the log-probabilities too, bit for bit on the CPU


def test_static_decode_greedy_tokens_are_generate_s(random_prompt: Prompt) -> None:
    """Whole requests, prompts prefilled dynamically (a prompt chunk is not a decode step)
    and every decode step static, four at once: transformers' greedy tokens."""
    loaded = tiny_model("llama")
    runner = ModelRunner(loaded, CacheConfig(num_blocks=256, block_size=4), static_decode=True)
    prompts = [random_prompt(length, 512) for length in (3, 9, 17, 30)]
    requests = [GreedyRequest(str(i), p, 12) for i, p in enumerate(prompts)]
    expected = [reference_tokens(loaded.model, p, 12) for p in prompts]
    run_greedy(runner, BlockManager(num_blocks=256, block_size=4), requests)
    assert [r.output for r in requests] == expected


def test_static_decode_step_waits_on_nothing() -> None:
    """The step's device part (its forward over the buffers) records no op that makes the
    host wait for the device; the dynamic step's forward does (its metadata reads lengths
    back), so the audit sees what it looks for."""
    dynamic, static = runners(tiny_model("llama"))
    sequences = decode_step([5, 17, 3])
    assert static.static is not None
    static.static.fill(sequences, 4)
    with SyncAudit() as audit:
        static.static.forward(4)
    assert dict(audit.ops) == {}
    with SyncAudit() as audit:
        dynamic.forward(sequences)
    assert audit.ops


def test_static_decode_buckets_are_powers_of_two_up_to_the_largest() -> None:
    loaded = tiny_model("llama")
    runner = ModelRunner(loaded, CacheConfig(num_blocks=16, block_size=4), static_decode=True)
    assert isinstance(runner.static, StaticDecode)
    assert runner.static.buckets == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert [runner.static.bucket(n) for n in (1, 3, 4, 5, 200)] == [1, 4, 4, 8, 256]
    prefill = ScheduledSequence(
        request_id="p", token_ids=(1, 2), num_computed_tokens=0, block_table=(1,)
    )
    assert not runner.static.takes([prefill])
    assert not runner.static.takes(decode_step([1] * 257))


def test_static_decode_plain_greedy_rows_take_the_graph_s_argmax() -> None:
    """A step of plain greedy rows (nothing moving a logit, no logprobs) takes its tokens from
    the argmax inside the step, with no sampler: the dynamic step's tokens. One row asking for
    logprobs sends the step through the sampler."""
    dynamic, static = runners(tiny_model("llama"))
    plain = SamplingInput(
        params=SamplingParams(temperature=0), num_output_tokens=0, eos_token_ids=()
    )
    sequences = [attrs.evolve(seq, sampling=plain) for seq in decode_step([3, 40, 11, 7, 0])]
    calls = []
    sample = static.sampler.sample
    static.sampler.sample = lambda *args: calls.append(1) or sample(*args)  # type: ignore[method-assign]
    step = SchedulerOutput(sequences=tuple(sequences))
    assert static.execute_model(step) == dynamic.execute_model(step)
    assert calls == []
    logprobs = attrs.evolve(plain, params=SamplingParams(temperature=0, logprobs=1))
    mixed = (attrs.evolve(sequences[0], sampling=logprobs), *sequences[1:])
    assert (
        static.execute_model(SchedulerOutput(sequences=mixed)).token_ids
        == dynamic.execute_model(SchedulerOutput(sequences=mixed)).token_ids
    )
    assert calls == [1]
