"""What a step gives of a prompt chunk's positions besides a sampled token: the log-probability
of each next prompt token (prompt_logprobs), and the chunk's hidden states pooled (embeddings,
loom/core/pooling.py). Both read the step's last hidden states, the chunk's rows."""

from __future__ import annotations

import torch

from loom.core.pooling import PoolRows
from loom.core.request import PromptScoring
from loom.core.request_output import Logprobs
from loom.model.decoder import DecoderModel
from loom.model.sampler import token_logprobs

SCORE_ROWS = 256  # logits rows at a time when scoring a prompt: 256 x 49,152 floats is 50 MB


def pool_hidden(model: DecoderModel, hidden: torch.Tensor, rows: PoolRows) -> tuple[float, ...]:
    """An embedding's chunk (`hidden` its rows) pooled: after the final norm, the sum of its
    rows from `rows.first_row` on, or that row alone."""
    first = rows.first_row
    normed = model.final_hidden(hidden[first:] if rows.mean else hidden[first : first + 1])
    return tuple(normed.float().sum(0).tolist())


def score_prompt(
    model: DecoderModel, hidden: torch.Tensor, scoring: PromptScoring
) -> tuple[Logprobs, ...]:
    """The log-probabilities of a chunk's next prompt tokens (`hidden` starts at the chunk's
    first row), `SCORE_ROWS` rows of logits at a time."""
    result: list[Logprobs] = []
    next_ids = scoring.next_token_ids
    for at in range(0, len(next_ids), SCORE_ROWS):
        first = scoring.first_row + at
        rows = hidden[first : first + min(SCORE_ROWS, len(next_ids) - at)]
        logits = model.compute_logits(rows).float()[:, : model.vocab_size]
        logprobs = torch.log_softmax(logits, dim=-1)
        result += token_logprobs(logprobs, next_ids[at : at + len(rows)], scoring.num_top)
    return tuple(result)
