"""Request bodies read as JSON in slices (loom/server/openai/json_body.py): what `json.loads`
reads, for any JSON, whitespace and all; what no request can hold, refused by name; and work
bounded by the body, however it is shaped (socket-free: a pure function)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.server.openai.json_body import MAX_DEPTH, RUN, BodyError, read

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(), inner, max_size=8),
    max_leaves=60,
)
NUMBERS = st.lists(
    st.integers(min_value=-(10**6), max_value=10**6) | st.floats(allow_nan=False), max_size=3000
)


@settings(max_examples=300, deadline=None)
@given(value=JSON, indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans())
def test_json_body_reads_what_json_loads_reads(
    value: Any, indent: int | None, ascii_only: bool
) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    try:
        text.encode()
    except UnicodeEncodeError:  # hypothesis' lone surrogates: refused, below
        return
    assert read(text.encode()) == json.loads(text)


@settings(max_examples=100, deadline=None)
@given(numbers=NUMBERS, separator=st.sampled_from([",", ", ", " ,\n\t"]))
def test_json_body_reads_runs_of_numbers_as_json_loads_does(
    numbers: list[float], separator: str
) -> None:
    """Token ids come as long arrays of numbers: read a run at a time, floats and ints mixed,
    runs longer than RUN and cut anywhere."""
    text = "[" + separator.join(json.dumps(n) for n in numbers) + "]"
    assert read(text.encode()) == json.loads(text)


def test_json_body_reads_the_literals_json_loads_takes() -> None:
    got = read(b"[NaN, Infinity, -Infinity, true, false, null, -0, 1e400]")
    assert math.isnan(got[0])
    assert got[1:] == [math.inf, -math.inf, True, False, None, 0, math.inf]


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"", "expected a value at character 0"),
        (b"\xff{}", "the body is not UTF-8"),
        (b"[1,2", "expected ',' at character 4"),
        (b"[1,]", "expected a value at character 3"),
        (b"[01]", "expected ',' at character 2"),
        (b"[1 2]", "expected ',' at character 3"),
        (b"[1.5x]", "expected ',' at character 4"),
        (b'{"a" 1}', "expected ':' at character 5"),
        (b'{"a":1,}', "expected a property name in double quotes at character 7"),
        (b"{1: 2}", "expected a property name in double quotes at character 1"),
        (b'{"a":1}x', "extra data after the JSON value at character 7"),
        (b'"\\ud800"', "holds a lone surrogate: not valid Unicode text"),
        (b'{"\\udfff": 1}', "holds a lone surrogate"),
        (b'"a\x01"', "Invalid control character"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), f"nests deeper than {MAX_DEPTH}"),
        (b"[" + b"1" * 5000 + b"]", "Exceeds the limit"),  # int()'s digit limit, in a run
        (b'{"a": ' + b"1" * 5000 + b"}", "Exceeds the limit"),  # and alone
    ],
)
def test_json_body_refuses_what_no_request_can_hold_saying_where(body: bytes, why: str) -> None:
    with pytest.raises(BodyError, match=why.replace("(", r"\(").replace(")", r"\)")):
        read(body)


def test_json_body_reads_a_run_cut_by_floats_once_a_number() -> None:
    """Runs of RUN - 1 integers each ended by a float (the run's last number goes on): each
    number is still matched once, not the rest of its run again for every number after."""
    numbers = ([7] * (RUN - 1) + [0.5]) * 300
    text = "[" + ",".join(json.dumps(n) for n in numbers) + "]"
    assert read(text.encode()) == numbers
