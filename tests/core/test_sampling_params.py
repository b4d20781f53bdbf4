"""Sampling validation: NaN-safe, and every message names the field and the limit."""

from __future__ import annotations

import math

import pytest

from loom.core.errors import InvalidRequestError
from loom.core.sampling_params import SamplingParams

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", NAN, r"temperature must be in \[0.0, 100.0\], got nan"),
        ("temperature", INF, r"temperature must be in \[0.0, 100.0\], got inf"),
        ("temperature", -0.5, r"temperature must be in \[0.0, 100.0\], got -0.5"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
        ("top_p", NAN, r"top_p must be in \(0, 1\], got nan"),
        ("top_k", -1, r"top_k must be in \[0, "),
        ("min_p", NAN, r"min_p must be in \[0.0, 1.0\], got nan"),
        ("min_p", 1.1, r"min_p must be in \[0.0, 1.0\]"),
        ("repetition_penalty", 0.0, r"repetition_penalty must be in \(0, 2\], got 0.0"),
        ("repetition_penalty", NAN, r"repetition_penalty must be in \(0, 2\]"),
        ("presence_penalty", -INF, r"presence_penalty must be in \[-2.0, 2.0\], got -inf"),
        ("frequency_penalty", 2.5, r"frequency_penalty must be in \[-2.0, 2.0\], got 2.5"),
        ("max_tokens", 0, r"max_tokens must be in \[1, "),
        ("max_tokens", -5, r"max_tokens must be in \[1, \d+\], got -5"),
        ("min_tokens", -1, r"min_tokens must be in \[0, "),
        ("seed", -1, r"seed must be in \[0, "),
        ("logprobs", 21, r"logprobs must be in \[0, 20\], got 21"),
        ("logprobs", -1, r"logprobs must be in \[0, 20\]"),
        ("stop", ("",), "each stop string must have 1 to 256 characters"),
        ("stop", ("x",) * 17, "stop holds at most 16 strings"),
        ("stop_token_ids", (-3,), r"stop_token_ids must be in \[0, "),
        ("stop_token_ids", tuple(range(65)), "stop_token_ids holds at most 64 ids"),
        ("logit_bias", ((5, NAN),), r"logit_bias values must be in \[-100, 100\], got nan"),
        ("logit_bias", ((5, -INF),), r"logit_bias values must be in \[-100, 100\], got -inf"),
        ("logit_bias", ((-1, 1.0),), r"logit_bias token ids must be in \[0, 2\^31\), got -1"),
        ("logit_bias", ((5, 1.0), (5, 2.0)), "logit_bias names a token id twice"),
        ("logit_bias", tuple((i, 1.0) for i in range(301)), "logit_bias holds at most 300"),
    ],
)
def test_sampling_params_rejects_bad_values_naming_field_and_limit(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_sampling_params_min_tokens_cannot_exceed_max_tokens() -> None:
    with pytest.raises(InvalidRequestError, match=r"min_tokens must be in \[0, 4\], got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_sampling_params_defaults_are_valid_and_greedy_is_temperature_near_zero() -> None:
    assert not SamplingParams().greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-40).greedy  # dividing by it would overflow
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
