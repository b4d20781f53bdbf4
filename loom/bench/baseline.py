"""The baseline: transformers' `generate` on the same prompts, in static batches, in this process.

Each batch of `concurrency` prompts is left-padded and generated together (greedy, exactly
`output_len` new tokens); a batch starts when the previous one ends, every request counting from
the start of the run, as if all had arrived at once. A logits processor stamps the time of each
step, so the batch's requests share their per-token arrival times.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from loom.bench.metrics import RequestTiming
from loom.bench.serving import Workload


class StepClock:
    """A logits processor that records when each step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_baseline(
    model: Any, pad_token_id: int, workload: Workload, concurrency: int
) -> tuple[list[RequestTiming], float]:
    prompts = workload.prompts
    timings: list[RequestTiming] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), concurrency):
        batch = prompts[first : first + concurrency]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        clock = StepClock()
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=workload.output_len,
                min_new_tokens=workload.output_len,  # ignore EOS, as the Loom runs do
                do_sample=False,
                logits_processor=[clock],
                pad_token_id=pad_token_id,
            )
        token_times = tuple(t - start for t in clock.times)
        timings += [
            RequestTiming(ok=True, num_prompt_tokens=len(p), token_times=token_times) for p in batch
        ]
    return timings, time.perf_counter() - start
