"""A minimal greedy driver over BlockManager + ModelRunner, and transformers' `generate` as oracle.

These tests drive the runner by hand, without the scheduler, so that each batch shape (decodes
with a prefill, chunked prompts, late arrivals, scattered blocks) is chosen on purpose. Tokens
come from the runner's own sampler, greedy.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from loom.core.block_manager import BlockManager
from loom.core.sampling_params import SamplingParams
from loom.core.step import SamplingInput, ScheduledSequence, SchedulerOutput
from loom.model.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0)


@attrs.define
class GreedyRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival_step: int = 0
    output: list[int] = attrs.field(factory=list)
    num_computed: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_tokens


@attrs.define
class StepLog:
    """What each step held, so tests can assert the batch shapes they meant to build."""

    num_steps: int = 0
    mixed_steps: int = 0  # a prefill chunk and a decode in the same forward
    chunked_prompts: int = 0  # prompt chunks that did not finish their prompt
    max_batch: int = 0
    block_tables: dict[str, tuple[int, ...]] = attrs.field(factory=dict)  # the last seen, each


def run_greedy(
    runner: ModelRunner,
    manager: BlockManager,
    requests: list[GreedyRequest],
    *,
    chunk_size: int | None = None,
    eos_token_id: int | None = None,
) -> StepLog:
    """Decode every request greedily, one forward per step, freeing blocks as requests finish."""
    log = StepLog()
    while not all(r.finished for r in requests):
        active = [r for r in requests if r.arrival_step <= log.num_steps and not r.finished]
        scheduled = []
        for r in active:
            end = len(r.token_ids)
            if r.num_computed < len(r.prompt) and chunk_size is not None:
                end = min(end, r.num_computed + chunk_size)
            if not manager.allocate(r.request_id, end):
                raise RuntimeError("test pool too small")
            scheduled.append(scheduled_sequence(r, end, manager.block_table(r.request_id)))
        if not scheduled:
            log.num_steps += 1
            continue
        result = runner.execute_model(SchedulerOutput(sequences=tuple(scheduled)))
        record_step(log, scheduled, requests)
        sampled = dict(zip(result.request_ids, result.token_ids, strict=True))
        for r, seq in zip(active, scheduled, strict=True):
            r.num_computed += len(seq.token_ids)
            if r.request_id in sampled:
                r.output.append(sampled[r.request_id])
                if eos_token_id is not None and r.output[-1] == eos_token_id:
                    r.max_tokens = len(r.output)
            if r.finished:
                manager.free(r.request_id)
    return log


def scheduled_sequence(
    request: GreedyRequest, end: int, block_table: tuple[int, ...]
) -> ScheduledSequence:
    """Tokens `num_computed:end` of the request; greedy sampling when they complete it."""
    tokens = request.token_ids
    sampling = SamplingInput(params=GREEDY, num_output_tokens=len(request.output), eos_token_ids=())
    return ScheduledSequence(
        request_id=request.request_id,
        token_ids=tuple(tokens[request.num_computed : end]),
        num_computed_tokens=request.num_computed,
        block_table=block_table,
        sampling=sampling if end == len(tokens) else None,
    )


def record_step(
    log: StepLog, scheduled: list[ScheduledSequence], requests: list[GreedyRequest]
) -> None:
    prompt_len = {r.request_id: len(r.prompt) for r in requests}
    lens = [len(s.token_ids) for s in scheduled]
    log.num_steps += 1
    log.max_batch = max(log.max_batch, len(scheduled))
    log.block_tables.update({s.request_id: s.block_table for s in scheduled})
    log.mixed_steps += int(min(lens) == 1 and max(lens) > 1)
    log.chunked_prompts += sum(
        s.num_computed_tokens + len(s.token_ids) < prompt_len[s.request_id] for s in scheduled
    )


def reference_tokens(hf_model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy `generate` for one prompt alone (it stops at EOS if the model has one)."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt], device=hf_model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf_model.device),
            max_new_tokens=max_tokens,
            do_sample=False,
        )
    return [int(t) for t in out[0, len(prompt) :]]
