"""Overlapped steps, the runner's side: a launched step's output, which may come later than the
launch, and the tokens a step sampled, kept on the device for the step after it.

With overlapped scheduling (loom/core/overlap.py) step N + 1 is scheduled and launched before
step N's tokens reach the host. A request of both decodes in N + 1 the token it samples in N:
its `ScheduledSequence.pending_token` row holds a placeholder, and the runner copies the token
into the step's input ids on the device, from the ids step N left there (`SampledTokens`). So
nothing waits for the host between the two launches. On a GPU a step's tokens come back through
pinned memory once the device has them (`Launched.output` waits for that copy; `ready` says
whether it is done); a step that samples on the host has its output at once.

Worked example: step N samples rows [A, B, C] -> ids [7, 3, 9]; step N + 1 is [C, D, A], where
C and A are pending and D is a prompt chunk of 3 tokens [d0, d1, d2]. Flat input ids
[0, d0, d1, d2, 0]: C's placeholder at 0 takes row 2 (9), A's at 4 takes row 0 (7):
`sources` gives [(0, 2), (2, 0)] (sequence, row), and the dynamic step's flat `at` is [0, 4].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import attrs
import torch

from loom.core.step import ModelRunnerOutput, ScheduledSequence


def always() -> bool:
    return True


@attrs.frozen
class Launched:
    """A step the runner launched: `output()` gives its result, waiting for the device's copy
    of its tokens if `ready()` is False."""

    output: Callable[[], ModelRunnerOutput]
    ready: Callable[[], bool] = always

    @classmethod
    def done(cls, output: ModelRunnerOutput) -> Launched:
        return cls(lambda: output)


@attrs.frozen
class SampledTokens:
    """A step's sampled tokens on the runner's device: request `r`'s is `token_ids[rows[r]]`
    (the requests that sampled one token: a drafted row is never pending)."""

    rows: dict[str, int]
    token_ids: torch.Tensor

    @classmethod
    def none(cls) -> SampledTokens:
        return cls({}, torch.zeros(0, dtype=torch.long))

    def sources(self, sequences: Sequence[ScheduledSequence]) -> list[tuple[int, int]]:
        """(index of the sequence, its row here) for each pending sequence of the next step."""
        found = []
        for i, seq in enumerate(sequences):
            if not seq.pending_token:
                continue
            row = self.rows.get(seq.request_id)
            if row is None:
                raise ValueError(f"request {seq.request_id}: no token of the last step to take")
            found.append((i, row))
        return found

    def fill(self, input_ids: torch.Tensor, sequences: Sequence[ScheduledSequence]) -> None:
        """The pending tokens put in a step's flat `input_ids` (the sequences' tokens one after
        another), on the device: no wait for the host."""
        sources = self.sources(sequences)
        if not sources:
            return
        starts = list(accumulate((len(seq.token_ids) for seq in sequences), initial=0))
        device = input_ids.device
        picked = self.token_ids[torch.tensor([row for _, row in sources], device=device)]
        at = torch.tensor([starts[i] for i, _ in sources], device=device)
        input_ids[at] = picked.to(input_ids.dtype)
