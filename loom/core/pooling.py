"""Embeddings: a request that pools its prompt's hidden states into one vector, and samples
nothing.

An embedding model (a sentence-transformers folder: Qwen3-Embedding, say) says how it pools:
the last token's hidden state (`last`, Qwen3-Embedding's) or the mean of every token's
(`mean`); the hidden states are the last layer's after the final norm, as transformers'
`last_hidden_state`. The server's `--task embed` and `--pooling` decide for any other model
(loom/model/pooling_config.py). The vector is then cut to its first `dimensions` (a
Matryoshka model's smaller embedding) and scaled to length 1 (`normalize`), in that order.

The runner pools each prompt chunk it computes (`PoolRows`): the last row of the chunk that
ends the prompt, or the sum of the chunk's rows from the first not yet pooled (after a
preemption the prompt is computed again, and pooled once). The request adds the chunks' sums
up; mean pooling reads every position, so such a request takes nothing from the prefix cache.
"""

from __future__ import annotations

import math
from typing import Literal

import attrs

from loom.core.errors import InvalidRequestError

PoolingKind = Literal["last", "mean"]
POOLING_KINDS: tuple[PoolingKind, ...] = ("last", "mean")
MAX_DIMENSIONS = 1 << 20  # beyond any model's hidden size (the model's own is checked later)


@attrs.frozen(kw_only=True)
class Pooling:
    """What an embedding request asks: its vector's length (None: the model's hidden size)
    and whether it is normalised (None: as the model says). `kind` is the model's, and
    `normalize` decided, by the engine at admission."""

    dimensions: int | None = None
    normalize: bool | None = None
    kind: PoolingKind | None = None

    def __attrs_post_init__(self) -> None:
        if self.dimensions is not None and not (1 <= self.dimensions <= MAX_DIMENSIONS):
            raise InvalidRequestError(
                f"dimensions must be in [1, {MAX_DIMENSIONS}], got {self.dimensions}"
            )


@attrs.frozen(kw_only=True)
class PoolRows:
    """What a step pools of one sequence's chunk: row `first_row` alone (`mean` False: the
    prompt's last token), or the sum of the rows from `first_row` to the chunk's end."""

    first_row: int
    mean: bool


def pool_rows(
    pooling: Pooling | None, start: int, end: int, num_pooled: int, num_prompt: int
) -> PoolRows | None:
    """What a step computing prompt tokens `start:end` pools, `num_pooled` positions being
    pooled already; None for nothing."""
    if pooling is None:
        return None
    if pooling.kind == "mean":
        first = max(start, num_pooled)
        return PoolRows(first_row=first - start, mean=True) if first < end else None
    if end == num_prompt and num_pooled < num_prompt:
        return PoolRows(first_row=end - 1 - start, mean=False)
    return None


def add_pooled(pooled: list[float], values: tuple[float, ...], mean: bool) -> list[float]:
    """The request's pooled values with a chunk's: summed (mean), or the last token's."""
    if not mean or not pooled:
        return list(values)
    return [a + b for a, b in zip(pooled, values, strict=True)]


def embedding(pooled: list[float], num_prompt: int, pooling: Pooling) -> tuple[float, ...]:
    """The request's vector: the mean (or the last token's), cut to `dimensions`, normalised."""
    vector = [v / num_prompt for v in pooled] if pooling.kind == "mean" else list(pooled)
    if pooling.dimensions is not None:
        vector = vector[: pooling.dimensions]
    if pooling.normalize:
        norm = math.sqrt(math.fsum(v * v for v in vector))
        vector = [v / max(norm, 1e-12) for v in vector]  # (torch's F.normalize: eps 1e-12)
    return tuple(vector)
