"""The oracle: greedy fp32 decoding through the runner gives exactly `generate`'s tokens."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import attrs
import pytest
import torch

from loom.bench.quality import logits
from loom.core.block_manager import BlockManager
from loom.core.config import CacheConfig
from loom.core.sampling_params import SamplingParams
from loom.core.step import ModelRunnerOutput, SamplingInput, ScheduledSequence, SchedulerOutput
from loom.engine.config import EngineConfig
from loom.engine.stats import ModelInfo
from loom.model.device import DTYPES
from loom.model.family import UnsupportedModelError
from loom.model.loader import LoadedModel
from loom.model.model_runner import ModelRunner
from tests.conftest import tiny_model
from tests.support.greedy import GreedyRequest, reference_tokens, run_greedy

Prompt = Callable[[int, int], list[int]]


def check_against_reference(
    loaded: LoadedModel,
    requests: list[GreedyRequest],
    *,
    num_blocks: int = 256,
    block_size: int = 4,
    chunk_size: int | None = None,
    manager: BlockManager | None = None,
) -> None:
    runner = ModelRunner(loaded, CacheConfig(num_blocks=num_blocks, block_size=block_size))
    manager = manager or BlockManager(num_blocks=num_blocks, block_size=block_size)
    expected = {
        r.request_id: reference_tokens(loaded.model, r.prompt, r.max_tokens) for r in requests
    }
    run_greedy(runner, manager, requests, chunk_size=chunk_size)
    assert {r.request_id: r.output for r in requests} == expected
    assert manager.num_free_blocks == manager.num_total_blocks


def test_model_runner_matches_generate_for_one_request(
    tiny: LoadedModel, random_prompt: Prompt
) -> None:
    check_against_reference(tiny, [GreedyRequest("a", random_prompt(11, 512), max_tokens=24)])


def test_model_runner_matches_generate_for_eight_requests_decoded_together(
    tiny: LoadedModel, random_prompt: Prompt
) -> None:
    lengths = [1, 3, 4, 5, 9, 16, 17, 30]
    requests = [
        GreedyRequest(f"r{i}", random_prompt(n, 512), max_tokens=12) for i, n in enumerate(lengths)
    ]
    runner = ModelRunner(tiny, CacheConfig(num_blocks=256, block_size=4))
    manager = BlockManager(num_blocks=256, block_size=4)
    expected = {r.request_id: reference_tokens(tiny.model, r.prompt, 12) for r in requests}
    log = run_greedy(runner, manager, requests)
    assert log.max_batch == 8
    assert {r.request_id: r.output for r in requests} == expected


def test_model_runner_matches_generate_when_a_prefill_joins_running_decodes(
    tiny: LoadedModel, random_prompt: Prompt
) -> None:
    requests = [
        GreedyRequest("early1", random_prompt(6, 512), max_tokens=16),
        GreedyRequest("early2", random_prompt(13, 512), max_tokens=16),
        GreedyRequest("late", random_prompt(21, 512), max_tokens=10, arrival_step=5),
    ]
    runner = ModelRunner(tiny, CacheConfig(num_blocks=256, block_size=4))
    manager = BlockManager(num_blocks=256, block_size=4)
    expected = {
        r.request_id: reference_tokens(tiny.model, r.prompt, r.max_tokens) for r in requests
    }
    log = run_greedy(runner, manager, requests)
    assert log.mixed_steps >= 1
    assert {r.request_id: r.output for r in requests} == expected


@pytest.mark.parametrize("chunk_size", [1, 3, 8])
def test_model_runner_matches_generate_with_a_prompt_prefilled_in_chunks(
    tiny: LoadedModel, random_prompt: Prompt, chunk_size: int
) -> None:
    requests = [
        GreedyRequest("long", random_prompt(29, 512), max_tokens=10),
        GreedyRequest("decoding", random_prompt(2, 512), max_tokens=20),
    ]
    runner = ModelRunner(tiny, CacheConfig(num_blocks=256, block_size=4))
    manager = BlockManager(num_blocks=256, block_size=4)
    expected = {
        r.request_id: reference_tokens(tiny.model, r.prompt, r.max_tokens) for r in requests
    }
    log = run_greedy(runner, manager, requests, chunk_size=chunk_size)
    assert log.chunked_prompts >= 29 // chunk_size - 1
    assert {r.request_id: r.output for r in requests} == expected


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_model_runner_matches_generate_across_block_boundaries(
    tiny: LoadedModel, random_prompt: Prompt, block_size: int
) -> None:
    # Prompt lengths just below, at and above multiples of the block size.
    lengths = sorted({max(1, k * block_size + d) for k in (1, 2) for d in (-1, 0, 1)})
    requests = [
        GreedyRequest(f"r{n}", random_prompt(n, 512), max_tokens=block_size + 3) for n in lengths
    ]
    check_against_reference(tiny, requests, num_blocks=512 // block_size + 8, block_size=block_size)


def test_model_runner_reads_kv_through_shuffled_scattered_block_tables(
    tiny: LoadedModel, random_prompt: Prompt
) -> None:
    manager = BlockManager(num_blocks=64, block_size=4)
    # Fill the pool with one-block fillers and free them in a random order: the free list is
    # now a shuffle, so the requests below get non-contiguous, out-of-order block ids.
    fillers = [f"filler{i}" for i in range(manager.num_total_blocks)]
    for filler in fillers:
        assert manager.allocate(filler, 1)
    random.Random(7).shuffle(fillers)
    for filler in fillers:
        manager.free(filler)
    requests = [
        GreedyRequest("a", random_prompt(19, 512), max_tokens=14),
        GreedyRequest("b", random_prompt(7, 512), max_tokens=14),
    ]
    runner = ModelRunner(tiny, CacheConfig(num_blocks=64, block_size=4))
    expected = {
        r.request_id: reference_tokens(tiny.model, r.prompt, r.max_tokens) for r in requests
    }
    log = run_greedy(runner, manager, requests)
    assert {r.request_id: r.output for r in requests} == expected
    for table in log.block_tables.values():
        assert list(table) != sorted(table)  # out of order
        assert any(b - a != 1 for a, b in itertools.pairwise(table))  # not contiguous


def test_model_runner_rejects_a_block_table_too_short(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny, CacheConfig(num_blocks=8, block_size=4))
    seq = ScheduledSequence(
        request_id="x", token_ids=(1, 2, 3, 4, 5), num_computed_tokens=0, block_table=(1,)
    )
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        runner.execute_model(SchedulerOutput(sequences=(seq,)))


def test_model_runner_samples_only_the_sequences_that_complete(tiny: LoadedModel) -> None:
    """A prompt chunk with more to come gets no token (and no LM head); the others one each."""
    runner = ModelRunner(tiny, CacheConfig(num_blocks=8, block_size=4))
    chunk = ScheduledSequence(
        request_id="chunk", token_ids=(1, 2, 3), num_computed_tokens=0, block_table=(1,)
    )
    done = attrs.evolve(chunk, request_id="done", block_table=(2,), sampling=greedy_input())
    result = runner.execute_model(SchedulerOutput(sequences=(chunk, done)))
    assert result.request_ids == ("done",)
    assert len(result.token_ids) == len(result.logprobs) == 1
    only_chunk = runner.execute_model(SchedulerOutput(sequences=(chunk,)))
    assert only_chunk == ModelRunnerOutput(request_ids=(), token_ids=(), logprobs=())


def greedy_input(logprobs: int | None = None) -> SamplingInput:
    params = SamplingParams(temperature=0, logprobs=logprobs)
    return SamplingInput(params=params, num_output_tokens=0, eos_token_ids=())


@pytest.mark.smollm2
def test_model_runner_matches_generate_on_smollm2(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "Explain gravity to a child in one sentence.",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in questions
    ]
    prompts = [list(p["input_ids"]) if not isinstance(p, list) else p for p in prompts]
    requests = [
        GreedyRequest(f"q{i}", p, max_tokens=24, arrival_step=2 * i) for i, p in enumerate(prompts)
    ]
    expected = {r.request_id: reference_tokens(smollm2.model, r.prompt, 24) for r in requests}
    runner = ModelRunner(smollm2, CacheConfig(num_blocks=128, block_size=16))
    manager = BlockManager(num_blocks=128, block_size=16)
    log = run_greedy(runner, manager, requests, chunk_size=10, eos_token_id=tokenizer.eos_token_id)
    assert log.mixed_steps >= 1
    assert log.chunked_prompts >= 1
    assert {r.request_id: r.output for r in requests} == expected
    assert manager.num_free_blocks == manager.num_total_blocks


def test_model_runner_in_bfloat16_tracks_transformers_in_bfloat16(random_prompt: Prompt) -> None:
    loaded = tiny_model("llama")
    loaded.model.to(torch.bfloat16)
    bf16 = LoadedModel(
        name=loaded.name,
        model=loaded.model,
        tokenizer=None,
        dtype=torch.bfloat16,
        device=loaded.device,
    )
    runner = ModelRunner(bf16, CacheConfig(num_blocks=16, block_size=4))
    assert runner.kv_cache.k[0].dtype == torch.bfloat16
    prompt = random_prompt(13, 512)
    seq = ScheduledSequence(
        request_id="x",
        token_ids=tuple(prompt),
        num_computed_tokens=0,
        block_table=(1, 2, 3, 4),
        sampling=greedy_input(logprobs=5),
    )
    (ours,) = runner.execute_model(SchedulerOutput(sequences=(seq,))).logprobs
    with torch.inference_mode():
        logits = bf16.model(torch.tensor([prompt])).logits[0, -1].float()
    theirs = torch.log_softmax(logits, dim=-1).topk(5)
    assert ours is not None
    assert [t.token_id for t in ours.top] == theirs.indices.tolist()
    assert ours.chosen.token_id == int(logits.argmax())
    ours_values = torch.tensor([t.logprob for t in ours.top])
    assert torch.allclose(ours_values, theirs.values, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("in_place", [True, False])
def test_model_runner_with_a_float16_pool_stays_close_to_float32(
    tiny: LoadedModel, random_prompt: Prompt, in_place: bool
) -> None:
    """`--kv-cache-dtype fp16`: a 30-token prefill, then 10 decodes, each position's logits
    within 1% of those over the float32 pool (relative L2; measured about 0.05%), the same
    top token at every position; decode read in place or over gathered blocks."""
    prompt = random_prompt(40, 512)

    def scored(kv_dtype: str) -> torch.Tensor:
        cache = CacheConfig(num_blocks=8, block_size=16, kv_cache_dtype=kv_dtype)
        runner = ModelRunner(tiny, cache)
        assert runner.kv_cache.k[0].dtype == (torch.float16 if kv_dtype == "fp16" else tiny.dtype)
        runner.model.decode_in_place &= in_place
        parts = [logits(runner, prompt[:30])]
        parts += [logits(runner, prompt[: i + 1], i) for i in range(30, 40)]
        return torch.cat(parts)

    exact, half = scored("auto"), scored("fp16")
    runner = ModelRunner(tiny, CacheConfig(num_blocks=8, kv_cache_dtype="fp16"))
    info = ModelInfo.of(tiny, runner, runner.max_model_len, EngineConfig())
    assert info.dtype == "float32"  # GetModelInfo names the model's dtype, not the pool's
    error = (half - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert float(error.max()) < 0.01, error
    assert torch.equal(half.argmax(dim=-1), exact.argmax(dim=-1))


@pytest.mark.parametrize("in_place", [True, False])
def test_model_runner_float16_pool_saturates_values_past_its_range(
    random_prompt: Prompt, in_place: bool
) -> None:
    """A value past float16's 65504 (keys and values of a layer scaled by 1e5, as a bfloat16 or
    float32 model may hold) is stored as the largest float16, never inf: every logit stays
    finite (inf in the pool made each score NaN), through the fused CPU write and the torch
    one."""
    loaded = tiny_model("llama")
    attention = loaded.model.model.layers[0].self_attn
    with torch.no_grad():
        attention.k_proj.weight.mul_(1e5)
        attention.v_proj.weight.mul_(1e5)
    runner = ModelRunner(loaded, CacheConfig(num_blocks=8, block_size=16, kv_cache_dtype="fp16"))
    runner.model.decode_in_place &= in_place
    runner.model.fused_rotary &= in_place  # else the K/V write is torch's
    prompt = random_prompt(20, 512)
    scored = torch.cat([logits(runner, prompt[:19]), logits(runner, prompt, 19)])
    assert torch.isfinite(scored).all()
    assert float(runner.kv_cache.v[0].float().abs().max()) == torch.finfo(torch.float16).max


def test_model_runner_kv_cache_dtype_names_are_the_dtype_names() -> None:
    """CacheConfig (loom/core, without torch) spells the dtypes out: the same names as the
    model's, so that each resolves (and a new name in one place fails here)."""
    choices = attrs.fields(CacheConfig).kv_cache_dtype.metadata["choices"]
    assert set(choices) == {"auto", *DTYPES}


def test_model_runner_refuses_a_draft_model_its_method_cannot_run_and_warns_of_a_dear_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """--speculative-method draft: q4 runs on the CPU in float32 alone (refused at start, not
    at the first step); a draft computed as the model is (no cheaper) is built, with a warning;
    the two pools share the memory one would have."""
    bf16 = attrs.evolve(tiny_model("llama"), dtype=torch.bfloat16, draft_quantization="q4")
    with pytest.raises(UnsupportedModelError, match=r"--speculative-quantization: .*float32"):
        ModelRunner(bf16, CacheConfig(num_blocks=8))
    exact = attrs.evolve(tiny_model("llama"), draft_quantization="none")
    memory = CacheConfig(kv_cache_memory=1 << 20)
    runner = ModelRunner(exact, memory)
    assert "no faster" in caplog.text
    assert runner.drafter is not None
    alone = ModelRunner(tiny_model("llama"), memory)
    assert runner.num_blocks == alone.num_blocks // 2
