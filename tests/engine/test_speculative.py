"""Speculative decoding through the engine, with tiny random-weight models: greedy output equals
transformers' `generate` with drafts on, under batching, preemption, chunking and prefix hits;
seeded sampling, penalties, min_tokens, logprobs and stop strings give what they give without
drafts; every block is free once the engine is idle."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio

from loom.core.config import CacheConfig, SchedulerConfig
from loom.core.constraint import Constraint, ConstraintKind
from loom.core.request_output import FinishReason, RequestOutput
from loom.core.sampling_params import SamplingParams
from loom.core.speculative import SpeculativeConfig
from loom.engine.engine import Engine
from loom.engine.stats import SpecDecodeStats
from loom.model.loader import LoadedModel
from tests.conftest import tiny_model
from tests.engine.test_engine import assert_idle, collect, run_against_reference, serving

NGRAM = SpeculativeConfig(
    speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3
)


def spec_of(engine: Engine) -> SpecDecodeStats:
    spec = engine.stats().spec_decode
    assert spec is not None
    return spec


@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_engine_greedy_with_ngram_drafts_matches_generate(family: str) -> None:
    engine = await run_against_reference(
        tiny_model(family), scheduler=SchedulerConfig(speculative=NGRAM)
    )
    spec = spec_of(engine)
    # Random weights fall into loops that the drafts predict, and not everywhere.
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


async def test_engine_greedy_with_ngram_drafts_matches_generate_under_preemption() -> None:
    engine = await run_against_reference(
        tiny_model("llama"),
        cache=CacheConfig(block_size=4, num_blocks=24),  # 92 slots for 16 requests of up to 64
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=16, speculative=NGRAM),
    )
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_chunked_prefills > 0
    assert spec_of(engine).num_accepted_tokens > 0


async def outputs_with_and_without_drafts(
    loaded: LoadedModel,
    prompt: Any,
    sampling: SamplingParams,
    scheduler: SchedulerConfig | None = None,
    **config: Any,
) -> tuple[list[RequestOutput], list[RequestOutput], SpecDecodeStats]:
    """The request alone without drafts; then with drafts (n-gram, unless `scheduler` says
    otherwise), beside a batch mate."""
    async with serving(loaded, **config) as engine:
        with trio.fail_after(60):
            plain = await collect(engine, prompt, sampling)
    scheduler = scheduler or SchedulerConfig(speculative=NGRAM)
    async with serving(loaded, scheduler=scheduler, **config) as engine:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                mate = attrs.evolve(sampling, seed=None, max_tokens=30)
                nursery.start_soon(collect, engine, [5, 6, 7], mate)
                drafted = await collect(engine, prompt, sampling)
            assert_idle(engine)
            return plain, drafted, spec_of(engine)


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


REPEATING = [3, 1, 4, 1, 5, 9, 2, 6] * 4


@pytest.mark.parametrize(
    "sampling",
    [
        # (temperatures low enough that the drafts are sometimes sampled)
        SamplingParams(temperature=0.1, seed=11, max_tokens=40),
        SamplingParams(temperature=0.1, top_k=20, top_p=0.9, seed=14, max_tokens=40),
        SamplingParams(
            temperature=0, repetition_penalty=1.05, frequency_penalty=0.05, max_tokens=40
        ),
        SamplingParams(
            temperature=0.1, seed=3, frequency_penalty=0.2, min_tokens=30, max_tokens=40
        ),
    ],
    ids=["seeded", "seeded-top-k-top-p", "greedy-penalties", "seeded-frequency-min-tokens"],
)
async def test_engine_sampling_gives_the_same_tokens_with_and_without_drafts(
    sampling: SamplingParams,
) -> None:
    loaded = tiny_model("llama", eos_token_id=2)
    plain, drafted, spec = await outputs_with_and_without_drafts(loaded, REPEATING, sampling)
    assert tokens_of(drafted) == tokens_of(plain)
    assert drafted[-1].finish_reason == plain[-1].finish_reason
    assert spec.num_accepted_tokens > 0


async def test_engine_logprobs_with_drafts_are_those_without() -> None:
    sampling = SamplingParams(temperature=0, logprobs=3, max_tokens=30)
    plain, drafted, spec = await outputs_with_and_without_drafts(
        tiny_model("llama"), REPEATING, sampling
    )
    assert spec.num_accepted_tokens > 0
    assert len(drafted) < len(plain)  # some steps gave several tokens, in one output each
    want = [lp for o in plain for lp in o.logprobs]
    got = [lp for o in drafted for lp in o.logprobs]
    assert [lp.chosen.token_id for lp in got] == [lp.chosen.token_id for lp in want]
    for a, b in zip(got, want, strict=True):
        assert a.chosen.logprob == pytest.approx(b.chosen.logprob, abs=1e-4)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


async def test_engine_stop_string_inside_accepted_drafts_ends_the_text_there(
    smollm2_tokenizer: Any,
) -> None:
    """The answer repeats one token, drafted and accepted, then turns: the stop string is the
    first new token's text, which a drafted step reaches."""
    loaded = tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)
    sampling = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain, drafted, spec = await outputs_with_and_without_drafts(loaded, REPEATING, sampling)
    assert tokens_of(drafted) == tokens_of(plain)
    assert spec.num_accepted_tokens > 0
    tokens = tokens_of(plain)
    turn = next(t for t in tokens if t != tokens[0])
    stop = smollm2_tokenizer.decode([turn]).strip()
    with_stop = attrs.evolve(sampling, stop=(stop,))
    plain, drafted, spec = await outputs_with_and_without_drafts(loaded, REPEATING, with_stop)
    assert drafted[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert "".join(o.text for o in drafted) == "".join(o.text for o in plain)
    assert stop not in "".join(o.text for o in drafted)
    assert spec.num_accepted_tokens > 0


async def test_engine_abort_while_drafting_frees_every_block() -> None:
    async with serving(tiny_model("llama"), scheduler=SchedulerConfig(speculative=NGRAM)) as engine:
        with trio.fail_after(60):
            sampling = SamplingParams(temperature=0, max_tokens=400)
            async with engine.generate(REPEATING, sampling) as stream:
                async for output in stream:
                    if len(output.token_ids) > 1:  # a step that accepted drafts
                        break
            await engine.until(lambda: engine.stats().num_running == 0)
            assert_idle(engine)


async def test_engine_constrained_output_with_drafts_is_the_output_without(
    smollm2_tokenizer: Any,
) -> None:
    """Drafts under a grammar: each drafted position sampled under the mask its grammar gives
    after the drafts before it; a draft the grammar refuses is never kept."""
    loaded = tiny_model("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer)
    accepted = []
    for spec in ("(one two three )+", "[a-z ]{1,200}"):
        constraint = Constraint(kind=ConstraintKind.REGEX, spec=spec)
        sampling = SamplingParams(temperature=0, max_tokens=40, constraint=constraint)
        prompt = "one two three one two three one two"
        plain, drafted, stats = await outputs_with_and_without_drafts(loaded, prompt, sampling)
        assert tokens_of(drafted) == tokens_of(plain)
        assert drafted[-1].finish_reason == plain[-1].finish_reason
        accepted.append((stats.num_accepted_tokens, stats.num_draft_tokens))
    assert accepted[0][0] > 0  # the forced text: its drafts are what the grammar forces
    assert accepted[1][1] > accepted[1][0]  # the free one: some drafts refused


def drafting(quantization: str, **scheduler: Any) -> SchedulerConfig:
    spec = SpeculativeConfig(speculative_method="draft", speculative_quantization=quantization)
    return SchedulerConfig(speculative=spec, **scheduler)


@pytest.mark.parametrize("quantization", ["q4", "none"])
async def test_engine_greedy_with_a_draft_model_matches_generate(quantization: str) -> None:
    """The model's own weights draft for it: in q4 (lossy on random weights: some drafts
    rejected), and exact (every draft accepted, its K/V kept in step with the target's)."""
    engine = await run_against_reference(tiny_model("llama"), scheduler=drafting(quantization))
    spec = spec_of(engine)
    assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    if quantization == "none":
        assert spec.num_accepted_tokens == spec.num_draft_tokens


async def test_engine_greedy_with_a_draft_model_matches_generate_under_preemption() -> None:
    engine = await run_against_reference(
        tiny_model("llama"),
        cache=CacheConfig(block_size=4, num_blocks=24),
        scheduler=drafting("none", max_num_batched_tokens=16, max_num_seqs=16),
    )
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_chunked_prefills > 0
    assert spec_of(engine).num_accepted_tokens == spec_of(engine).num_draft_tokens > 0


async def test_engine_seeded_sampling_with_a_draft_model_gives_the_same_tokens() -> None:
    sampling = SamplingParams(temperature=0.2, seed=5, max_tokens=40)
    plain, drafted, spec = await outputs_with_and_without_drafts(
        tiny_model("llama"), REPEATING, sampling, scheduler=drafting("q4")
    )
    assert tokens_of(drafted) == tokens_of(plain)
    assert spec.num_accepted_tokens > 0
