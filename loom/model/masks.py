"""A step's token masks, from llguidance's bitmasks (loom/model/grammar.py) to what the
sampler applies (loom/model/sampler.py).

    bitmask [rows, words] ── masks_of ──▶ StepMasks: per constrained row, either
        the tokens it allows, when they are few (NARROW): the sampler samples among
            those alone, greedy or random, as it would over the whole masked row;
        or its row of the logits' bias (0 where allowed, -inf elsewhere), for a row that
            allows more: `apply_masks` adds it to the row's logits.

Why the narrow rows: a random row's sample draws one exponential per token of the vocabulary
(1.2 ms for 49,152 on a Zen 4 core, the largest cost a row adds to a step on the CPU), and a
grammar's row often allows a handful (a JSON object's opening and its keys): drawn over
those, it costs next to nothing, and its bias is never built. Sampling among the allowed
tokens gives each the probability the masked row gives it (the others' are 0 there).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

NARROW = 4096  # tokens a row may allow and be sampled among them alone
SHIFTS = np.arange(32, dtype=np.uint32)


@attrs.frozen
class StepMasks:
    """The constrained rows' masks, in the step's order: `allowed[i]` the token ids row i
    allows, ascending, if they are few, else None; `bias` one row for each of the others, in
    order."""

    allowed: list[torch.Tensor | None]
    bias: torch.Tensor


def masks_of(bitmask: torch.Tensor, vocab_size: int, narrow: int = NARROW) -> StepMasks:
    """A step's masks from llguidance's int32 bitmask [rows, words] (bit t of a row: token t
    allowed), a row that allows at most `narrow` tokens by its ids. In numpy, on one core:
    torch's ops called from a mask thread would start a second OpenMP team beside the forward
    pass's, and the two teams' spinning threads halved the step rate on 2 cores."""
    words = bitmask.numpy().view(np.uint32)
    counts = np.bitwise_count(words).sum(axis=1).tolist()
    allowed: list[torch.Tensor | None] = []
    for row, count in zip(words, counts, strict=True):
        ids = ids_of(row, vocab_size) if count <= narrow else None
        allowed.append(torch.from_numpy(ids) if ids is not None and len(ids) else None)
    wide = words[[i for i, ids in enumerate(allowed) if ids is None]]
    bits = np.unpackbits(wide.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return StepMasks(allowed=allowed, bias=bias_of(bits))


def ids_of(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids whose bits are set in one row of mask words, ascending: only its words that
    are not 0 unpacked (a row of few tokens has few)."""
    set_words = np.flatnonzero(words)
    bits = (words[set_words][:, None] >> SHIFTS) & 1
    ids: np.ndarray = (set_words[:, None] * 32 + SHIFTS)[bits.astype(bool)]
    return ids[ids < vocab_size]


def bias_of(bits: np.ndarray) -> torch.Tensor:
    """The float32 bias to add to logits for unpacked mask bits: 0 where a bit is set, -inf
    elsewhere (1 - 1/bit; a bool mask's masked_fill costs ten times as much: 13 ms for 64 rows
    of 49,152 on 2 cores, against about 1 for an add)."""
    with np.errstate(divide="ignore"):
        return torch.from_numpy(1.0 - 1.0 / bits.astype(np.float32))


def apply_masks(logits: torch.Tensor, rows: Sequence[int], bias: torch.Tensor) -> torch.Tensor:
    """`logits` with row `rows[i]` cut to what `bias[i]` allows."""
    if not rows:
        return logits
    index = torch.tensor(list(rows), device=logits.device)
    return logits.index_add(0, index, bias.to(logits.device))
