"""The baseline: transformers' `generate` on the same prompts, in static batches, in this process,
on the server's device and in its dtype (`loom bench --baseline` loads it there).

Each batch of `concurrency` prompts is left-padded and generated together (greedy, exactly
`output_len` new tokens); a batch starts when the previous one ends, every request counting from
the start of the run, as if all had arrived at once. A logits processor stamps the time of each
step, so the batch's requests share their per-token arrival times.
"""

from __future__ import annotations

import argparse
import shlex
import time
from typing import Any

import torch

from loom.bench.metrics import RequestTiming
from loom.bench.serving import Workload
from loom.model.device import resolve_device, resolve_dtype


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
        ids = [[pad_token_id] * (width - len(p)) + list(p) for p in batch]
        input_ids = torch.tensor(ids, device=model.device)
        attention_mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device
        )
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


def baseline_placement(baseline: bool, serve_args: str) -> tuple[torch.device, torch.dtype]:
    """Where `--baseline` runs transformers: on the launched server's device, in its dtype
    (`--device` and `--dtype` among --serve-args, auto as `loom serve`'s), so that the two
    compare on one device; without --baseline, the CPU (the model serves as the tokenizer)."""
    if not baseline:
        return torch.device("cpu"), torch.float32
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--device", default="auto")
    flags.add_argument("--dtype", default="auto")
    known, _ = flags.parse_known_args(shlex.split(serve_args))
    device = resolve_device(known.device)
    return device, resolve_dtype(known.dtype, device)
