"""Sampling parameters, validated NaN-safely, each error naming the field and its limit.

Field names and defaults follow vLLM and OpenAI. Comparisons are written `not (lo <= x <= hi)`,
which rejects NaN, never `x < lo or x > hi`, which lets NaN through.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from loom.core.constraint import Constraint
from loom.core.errors import InvalidRequestError
from loom.core.pooling import Pooling

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # token ids a logit_bias may name
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: each bias in [-100, 100]
# Below this a temperature is greedy (as in vLLM): dividing logits by 1e-40 overflows to inf.
GREEDY_BELOW = 1e-5


def logit_bias_pairs(bias: Mapping[int, float]) -> tuple[tuple[int, float], ...]:
    """A wire's logit_bias map as SamplingParams takes it, its size refused before it is read."""
    check_logit_bias_size(len(bias))
    return tuple(sorted(bias.items()))


def check_logit_bias_size(size: int) -> None:
    if size > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            f"logit_bias holds at most {MAX_LOGIT_BIAS} token ids, got {size}"
        )


def check_logit_bias(pairs: tuple[tuple[int, float], ...]) -> None:
    """Each id a token id, each bias in range, no id twice (the vocabulary is admission's)."""
    check_logit_bias_size(len(pairs))
    for token_id, bias in pairs:
        if not (0 <= token_id < 1 << 31):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, 2^31), got {token_id}")
        if not (-LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE):
            raise InvalidRequestError(
                f"logit_bias values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                f"got {bias} for token id {token_id}"
            )
    if len({token_id for token_id, _ in pairs}) < len(pairs):
        raise InvalidRequestError("logit_bias names a token id twice")


def check_range(field: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):
        raise InvalidRequestError(f"{field} must be in [{lo}, {hi}], got {value}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) means greedy
    top_p: float = 1.0  # (0, 1]; 1 disables
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # [0, 1]; 0 disables
    repetition_penalty: float = 1.0  # (0, 2]; 1 disables; prompt and output tokens
    presence_penalty: float = 0.0  # [-2, 2]; output tokens
    frequency_penalty: float = 0.0  # [-2, 2]; output tokens
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to return besides the chosen token, 0..20
    # The prompt's own log-probabilities (each token's given those before it), with this many
    # top alternatives, 0..20; such a request takes nothing from the prefix cache.
    prompt_logprobs: int | None = None
    # What the output must match (structured outputs); its grammar decides where it ends.
    constraint: Constraint | None = None
    # Added to the logits of these token ids (sorted (id, bias) pairs) before sampling, after
    # the penalties: -100 bans a token in effect, +100 all but forces it. Ids are checked
    # against the vocabulary where the model is known (admission).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Loom's: False keeps this request's steps free of draft tokens when speculative decoding
    # is on (its output is the same either way; only its speed and its steps' cost differ).
    speculative: bool = True
    # An embedding: the prompt pooled into a vector (loom/core/pooling.py); nothing sampled.
    pooling: Pooling | None = None

    def __attrs_post_init__(self) -> None:
        check_range("temperature", self.temperature, 0.0, 100.0)
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        check_range("top_k", self.top_k, 0, 1 << 30)
        check_range("min_p", self.min_p, 0.0, 1.0)
        if not (0.0 < self.repetition_penalty <= 2.0):
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"
            )
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            check_range("seed", self.seed, 0, (1 << 63) - 1)
        if self.max_tokens is not None:
            check_range("max_tokens", self.max_tokens, 1, 1 << 30)
        check_range("min_tokens", self.min_tokens, 0, self.max_tokens or 1 << 30)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop holds at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not (1 <= len(s) <= MAX_STOP_STRING_CHARS):
                raise InvalidRequestError(
                    f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids")
        for token_id in self.stop_token_ids:
            check_range("stop_token_ids", token_id, 0, 1 << 31)
        check_logit_bias(self.logit_bias)
        if self.logprobs is not None:
            check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.pooling is not None and (self.constraint or self.prompt_logprobs is not None):
            raise InvalidRequestError("an embedding samples nothing: no constraint, no logprobs")
        if self.constraint is not None:
            taken = {
                "ignore_eos": self.ignore_eos,
                "min_tokens": self.min_tokens,
                "stop": self.stop,
                "stop_token_ids": self.stop_token_ids,
            }
            for field, value in taken.items():
                if value:
                    raise InvalidRequestError(
                        f"{field} cannot be combined with a constraint: its grammar decides "
                        "where the output ends"
                    )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
