"""Batched sampling on hand-made logits."""

from __future__ import annotations

import math

import attrs
import numpy as np
import torch

from loom.core.sampling_params import SamplingParams
from loom.core.step import SamplingInput
from loom.model.masks import NARROW, masks_of
from loom.model.sampler import Sampler

CPU = torch.device("cpu")
VOCAB = 6


def row(
    params: SamplingParams, output: tuple[int, ...] = (), eos: tuple[int, ...] = ()
) -> SamplingInput:
    """A request with prompt tokens 1, 2, 3."""
    return SamplingInput(
        params=params,
        num_output_tokens=len(output),
        eos_token_ids=eos,
        prompt_token_ids=(1, 2, 3),
        output_token_ids=output,
    )


def requests_with(*params: SamplingParams) -> list[SamplingInput]:
    return [row(p) for p in params]


def logits_rows(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


BASE = [0.0, 3.0, 2.5, 1.0, -1.0, 0.5]  # argmax: token 1


def test_sampler_greedy_and_degenerate_cuts_take_the_argmax() -> None:
    sampler = Sampler(VOCAB, CPU)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ]
    torch.manual_seed(0)
    for _ in range(20):
        out = sampler.sample(logits_rows(*[BASE] * 4), requests_with(*params))
        assert out.token_ids == [1, 1, 1, 1]


def test_sampler_greedy_takes_the_first_of_tied_maxima_as_argmax_does() -> None:
    """Ties (the first maximum), a NaN (taken as the maximum) and a row of -inf, each as
    torch's argmax chooses: the sampler takes max's indices, which are faster on the CPU."""
    sampler = Sampler(VOCAB, CPU)
    logits = logits_rows(
        [0.0, 3.0, 1.0, 3.0, -1.0, 3.0],
        [0.0, 1.0, float("nan"), 2.0, float("nan"), 0.5],
        [float("-inf")] * VOCAB,
    )
    out = sampler.sample(logits, requests_with(*[SamplingParams(temperature=0)] * 3))
    assert out.token_ids == [1, 2, 0] == logits.argmax(dim=-1).tolist()


def test_sampler_top_k_and_top_p_keep_only_their_tokens() -> None:
    sampler = Sampler(VOCAB, CPU)
    torch.manual_seed(0)
    rows = 400
    top_k = sampler.sample(
        logits_rows(*[BASE] * rows), requests_with(*[SamplingParams(top_k=2)] * rows)
    )
    assert set(top_k.token_ids) == {1, 2}
    # softmax(BASE): tokens 1 and 2 hold ~0.79 of the mass; top_p 0.7 needs both, not token 3.
    top_p = sampler.sample(
        logits_rows(*[BASE] * rows), requests_with(*[SamplingParams(top_p=0.7)] * rows)
    )
    assert set(top_p.token_ids) == {1, 2}


def test_sampler_temperature_sampling_follows_the_distribution() -> None:
    sampler = Sampler(3, CPU)
    torch.manual_seed(1)
    probs = [0.5, 0.3, 0.2]
    rows = 4000
    logits = torch.log(torch.tensor([probs] * rows))
    out = sampler.sample(logits, requests_with(*[SamplingParams(temperature=1.0)] * rows))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=3) / rows
    assert torch.allclose(counts, torch.tensor(probs), atol=0.03)


def test_sampler_seed_gives_the_same_tokens_whatever_the_batch_mates() -> None:
    sampler = Sampler(VOCAB, CPU)
    flat = [0.0] * VOCAB  # uniform: every token equally likely, so only the seed decides

    def draw(with_mates: bool) -> list[int]:
        tokens: list[int] = []
        for i in range(30):
            seeded = row(SamplingParams(seed=42), output=tuple(tokens))
            batch = [seeded]
            if with_mates:
                batch = [*requests_with(*[SamplingParams(seed=i)] * (i % 3)), seeded]
                batch += requests_with(SamplingParams(temperature=0.7))
            out = sampler.sample(logits_rows(*[flat] * len(batch)), batch)
            tokens.append(out.token_ids[batch.index(seeded)])
        return tokens

    alone = draw(with_mates=False)
    assert draw(with_mates=True) == alone
    assert len(set(alone)) > 1  # it did sample


def test_sampler_penalties_push_down_seen_tokens() -> None:
    sampler = Sampler(VOCAB, CPU)
    # Prompt tokens are 1, 2, 3 (`row`). Repetition penalty 2: 3.0 -> 1.5, 2.5 -> 1.25.
    [repetition] = requests_with(SamplingParams(temperature=0, repetition_penalty=2.0))
    assert sampler.sample(logits_rows(BASE), [repetition]).token_ids == [1]  # 1.5 still the max
    [strong] = requests_with(SamplingParams(temperature=0, repetition_penalty=2.0))
    logits = [0.0, 3.0, 2.5, 1.0, -1.0, 2.0]
    assert sampler.sample(logits_rows(logits), [strong]).token_ids == [5]  # 2.0 beats 1.5
    frequency = row(SamplingParams(temperature=0, frequency_penalty=1.0), output=(1, 1))
    assert sampler.sample(logits_rows(BASE), [frequency]).token_ids == [2]  # 3 - 2 * 1 < 2.5
    presence = row(SamplingParams(temperature=0, presence_penalty=0.6), output=(1, 1, 1))
    assert sampler.sample(logits_rows(BASE), [presence]).token_ids == [2]  # 3 - 0.6 < 2.5


def test_sampler_min_tokens_forbids_eos_and_stop_ids_until_reached() -> None:
    sampler = Sampler(VOCAB, CPU)
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(2,))
    assert sampler.sample(logits_rows(BASE), [row(params, eos=(1,))]).token_ids == [3]
    reached = row(params, output=(0, 0), eos=(1,))
    assert sampler.sample(logits_rows(BASE), [reached]).token_ids == [1]


def test_sampler_logit_bias_moves_its_row_alone_and_not_its_logprobs() -> None:
    """A bias is added to its own row's logits, after the penalties (a repetition penalty of 2
    halves BASE's 3.0 and 2.5 to 1.5 and 1.25, +1 and +1.5: token 2 wins; biased first, the two
    would tie and token 1 win), and the logprobs stay the raw model's; a constrained row's
    narrow gather takes the biased logits too."""
    sampler = Sampler(VOCAB, CPU)
    biased = SamplingParams(temperature=0, logit_bias=((1, 1.0), (2, 1.5)), repetition_penalty=2.0)
    banned = SamplingParams(temperature=0, logit_bias=((1, -100.0),), logprobs=1)
    forced = SamplingParams(temperature=1.0, logit_bias=((4, 100.0),))
    plain = SamplingParams(temperature=0, logprobs=1)
    out = sampler.sample(logits_rows(*[BASE] * 4), requests_with(biased, banned, forced, plain))
    assert out.token_ids == [2, 2, 4, 1]
    assert out.logprobs[1] is not None
    assert out.logprobs[3] is not None
    raw = torch.log_softmax(logits_rows(BASE), dim=-1)[0]
    assert out.logprobs[1].chosen.logprob == raw[2].item()
    assert out.logprobs[1].top[0].logprob == out.logprobs[3].top[0].logprob == raw[1].item()
    narrow = constrained(SamplingParams(temperature=0, logit_bias=((1, -100.0),)))
    masks = masks_of(bitmask([{1, 3}], VOCAB), VOCAB, NARROW)
    assert sampler.sample(logits_rows(BASE), [narrow], lambda: masks).token_ids == [3]


def test_sampler_tiny_temperature_and_penalty_stay_finite() -> None:
    """temperature=1e-40 and repetition_penalty=1e-40 are valid floats on the wire; dividing
    logits by them overflows to inf, and a NaN distribution always picked token 0."""
    sampler = Sampler(VOCAB, CPU)
    torch.manual_seed(0)
    cold = sampler.sample(
        logits_rows(*[BASE] * 50), requests_with(*[SamplingParams(temperature=1e-40)] * 50)
    )
    assert set(cold.token_ids) == {1}  # the argmax
    tiny = SamplingParams(temperature=1.0, repetition_penalty=1e-40)
    harsh = sampler.sample(logits_rows(*[BASE] * 200), requests_with(*[tiny] * 200))
    # Prompt tokens 1, 2, 3 have positive logits, each divided by 1e-40: they share the mass.
    assert set(harsh.token_ids) == {1, 2, 3}


def test_sampler_logprobs_of_the_chosen_token_and_the_top_alternatives() -> None:
    sampler = Sampler(VOCAB, CPU)
    reqs = requests_with(
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=0),
    )
    out = sampler.sample(logits_rows(BASE, BASE, BASE), reqs)
    expected = torch.log_softmax(torch.tensor(BASE), dim=-1)
    first = out.logprobs[0]
    assert first is not None
    assert first.chosen.token_id == 1
    assert math.isclose(first.chosen.logprob, float(expected[1]), rel_tol=1e-5)
    assert [t.token_id for t in first.top] == [1, 2, 3]
    assert [t.logprob for t in first.top] == sorted((t.logprob for t in first.top), reverse=True)
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third is not None
    assert third.top == ()


def bitmask(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """llguidance's int32 bitmask for rows that allow these tokens."""
    bits = torch.zeros(len(allowed), (vocab + 31) // 32 * 32, dtype=torch.uint8)
    for i, tokens in enumerate(allowed):
        bits[i, sorted(tokens)] = 1
    packed = np.packbits(bits.numpy(), axis=1, bitorder="little")
    return torch.from_numpy(packed.view(np.int32).copy())


def constrained(params: SamplingParams, output: tuple[int, ...] = ()) -> SamplingInput:
    return attrs.evolve(row(params, output), constrained=True)


def test_sampler_a_narrow_row_samples_among_its_tokens_as_the_masked_row_would() -> None:
    """A constrained row that allows few tokens is sampled among them alone (its logits
    gathered); one that allows more has its bias added to the whole row. Both follow the
    distribution the mask leaves, greedy rows take the argmax of what is allowed, and the
    free rows beside them are untouched."""
    vocab, rows = 8, 3000
    probs = torch.tensor([0.05, 0.3, 0.05, 0.1, 0.2, 0.05, 0.15, 0.1])
    allowed = {1, 4, 6}
    expected = torch.zeros(vocab)
    expected[sorted(allowed)] = probs[sorted(allowed)] / probs[sorted(allowed)].sum()
    sampler = Sampler(vocab, CPU)
    for narrow in (NARROW, 0):  # every constrained row narrow, then every one wide
        torch.manual_seed(3)
        inputs = [constrained(SamplingParams(temperature=1.0))] * rows
        inputs += [row(SamplingParams(temperature=1.0))] * rows
        inputs += [constrained(SamplingParams(temperature=0)), row(SamplingParams(temperature=0))]
        masks = masks_of(bitmask([allowed] * (rows + 1), vocab), vocab, narrow)
        assert (masks.allowed[0] is not None) == bool(narrow)
        logits = torch.log(probs).repeat(len(inputs), 1)
        out = sampler.sample(logits, inputs, lambda masks=masks: masks).token_ids
        counts = torch.bincount(torch.tensor(out[:rows]), minlength=vocab) / rows
        assert torch.allclose(counts, expected, atol=0.03), (narrow, counts)
        free = torch.bincount(torch.tensor(out[rows : 2 * rows]), minlength=vocab) / rows
        assert torch.allclose(free, probs, atol=0.03), (narrow, free)
        assert out[-2:] == [1, 1]


def test_sampler_a_seeded_narrow_row_draws_the_same_whatever_its_mates() -> None:
    """A seeded constrained row is sampled at its own width, one exponential per token it
    allows, from its own generator: a mate of another width, which pads the gathered rows
    and moves their softmax by an ulp, changes nothing, even with top_p on the boundary of
    the row's own cumulative mass (padded with its mates, 109 of 3,000 such draws differed).
    600 rows of random logits, each alone and beside a mate."""
    vocab, allowed = 256, [10, 20, 30, 40, 50]
    sampler = Sampler(vocab, CPU)
    differ = 0
    for trial in range(600):
        logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(trial))
        probs = torch.softmax(logits[0, allowed], -1).sort(descending=True).values
        boundary = float(np.float32((probs.cumsum(-1) - probs)[2].item()))
        seeded = constrained(SamplingParams(seed=1234, top_p=boundary))
        alone = masks_of(bitmask([set(allowed)], vocab), vocab)
        mated = masks_of(bitmask([set(allowed), set(range(200))], vocab), vocab)
        first = sampler.sample(logits[:1], [seeded], lambda m=alone: m).token_ids[0]
        batch = [seeded, constrained(SamplingParams())]
        second = sampler.sample(logits, batch, lambda m=mated: m).token_ids[0]
        differ += first != second
        assert first in allowed
    assert differ == 0


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_verifying_drafts_by_sampling_each_position_keeps_the_distribution() -> None:
    """Speculative decoding's acceptance (loom/core/speculative.py): each position sampled as
    without drafts, drafts kept while they match. One-hot drafts (the n-gram's): the emitted
    tokens follow the target's distribution, position by position; 20,000 sequences of two
    rows, a likely draft and then an unlikely one."""
    from loom.core.speculative import emitted, sampling_rows
    from loom.core.step import ScheduledSequence

    torch.manual_seed(0)
    logits = [[2.0, 1.0, 0.5, 0.0, -0.5, -1.0], [0.0, 1.5, 0.3, -0.2, 0.8, -1.5], [0.0] * 6]
    p = [torch.softmax(torch.tensor(r), dim=0).numpy() for r in logits]
    num = 20_000
    seq = ScheduledSequence(
        request_id="r",
        token_ids=(1, 0, 3),
        num_computed_tokens=3,
        block_table=(1,),
        sampling=row(SamplingParams(temperature=1.0)),
        draft_token_ids=(0, 3),  # draft 0 is likely (p 0.47), draft 3 not (p 0.09)
    )
    rows = sampling_rows([seq] * num)
    sampled = Sampler(VOCAB, CPU).sample(logits_rows(*logits * num), rows)
    kept = emitted([seq] * num, sampled.token_ids, sampled.logprobs)
    tokens = np.array(kept.token_ids)
    firsts, seconds, at = [], [], 0
    for _ in range(num):  # each sequence: its first token, then more while drafts matched
        firsts.append(tokens[at])
        n = 1 if tokens[at] != 0 else (2 if tokens[at + 1] != 3 else 3)
        if n >= 2:
            seconds.append(tokens[at + 1])
        at += n
    assert at == len(tokens)
    # Critical chi-square values at p = 0.001 with 5 degrees of freedom: 20.5
    assert chi_square(np.bincount(firsts, minlength=VOCAB), p[0]) < 20.5
    assert chi_square(np.bincount(seconds, minlength=VOCAB), p[1]) < 20.5
    assert abs(len(seconds) / num - p[0][0]) < 0.02  # draft 0 accepted as often as sampled
