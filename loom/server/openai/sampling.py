"""The sampling fields of an OpenAI request body (chat and completions alike) read into
SamplingParams: their types here, their ranges SamplingParams's own checks (and admission's,
for token ids against the vocabulary), the same as for a gRPC request.

Taken: temperature, top_p, seed, stop, presence_penalty, frequency_penalty, logit_bias
(`{"token id": bias}`, at most 300 ids, each bias in [-100, 100]), logprobs (chat: top_logprobs
too); vLLM's extensions top_k, min_p, repetition_penalty, min_tokens, ignore_eos and
stop_token_ids; Loom's `speculative` (false: no draft tokens for this request); structured
outputs, OpenAI's response_format and vLLM's structured_outputs
(loom/server/openai/structured.py)."""

from __future__ import annotations

from typing import Any

from loom.core.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams, check_logit_bias_size
from loom.server.openai.errors import invalid
from loom.server.openai.fields import int_list, optional, present
from loom.server.openai.structured import constraint_of

SAMPLING_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def sampling_of(
    body: dict[str, Any], max_tokens: int | None, logprobs: int | None, echo: bool
) -> SamplingParams:
    """The sampling fields: their types here, their ranges SamplingParams's own checks. With
    `echo`, `logprobs` covers the prompt too (what lm-eval scores a continuation by)."""
    top_k = optional(body, "top_k", int)
    prompt_logprobs = logprobs if echo else None
    return SamplingParams(
        **present(body, *SAMPLING_FLOATS, kind=float),
        **present(body, "seed", "min_tokens", kind=int),
        top_k=0 if top_k is None or top_k == -1 else top_k,  # vLLM's -1: off
        max_tokens=max_tokens,
        stop=stop_strings(body.get("stop")),
        stop_token_ids=tuple(
            int_list(body.get("stop_token_ids") or [], "stop_token_ids", MAX_STOP_TOKEN_IDS)
        ),
        ignore_eos=optional(body, "ignore_eos", bool) or False,
        logit_bias=logit_bias_of(body.get("logit_bias")),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        constraint=constraint_of(body),
        speculative=optional(body, "speculative", bool) is not False,
    )


def logit_bias_of(given: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, `{"token id": bias}`, as sorted pairs; its size is refused before
    any entry is read, the ids' and values' ranges are SamplingParams's and admission's."""
    if given is None:
        return ()
    if not isinstance(given, dict):
        raise invalid("logit_bias must be an object of token ids to numbers", "logit_bias")
    check_logit_bias_size(len(given))
    pairs = []
    for key, value in given.items():
        if not (key.isascii() and key.isdecimal() and len(key) <= 10):
            raise invalid(f"logit_bias keys must be token ids, got {key[:32]!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid("logit_bias values must be numbers", "logit_bias")
        try:
            pairs.append((int(key), float(value)))
        except OverflowError:
            raise invalid("logit_bias values must be in [-100, 100]", "logit_bias") from None
    return tuple(sorted(pairs))


def stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise invalid("stop must be a string or a list of strings", "stop")
