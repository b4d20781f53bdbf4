"""Schemas whose compile takes long or little, and how long on this machine: the tests of
constraints' compiles set every time limit from these figures (`limits`), never from a
constant that a faster or slower machine would cross."""

from __future__ import annotations

import json
import time
from typing import Any

import attrs
import pytest

from loom.core.config import ConstraintConfig
from loom.core.constraint import Constraint, ConstraintKind
from loom.model.grammar import Grammars

SLOW, QUICK = 3000, 20  # properties
LARGE = 1 << 20  # max_constraint_bytes for the slow schemas (88 KB)
LLGUIDANCE_STEP_ITEMS = 50_000  # llguidance's step_max_items


def schema(tag: str, properties: int) -> Constraint:
    """An object of `properties` optional integers: its compile time grows with the count."""
    props = {f"{tag}{i}": {"type": "integer"} for i in range(properties)}
    return Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=json.dumps({"properties": props}))


@attrs.frozen
class Timing:
    slow: float  # seconds a `schema(tag, SLOW)` takes to compile here
    quick: float  # and a `schema(tag, QUICK)`


def measure(tokenizer: Any) -> Timing:
    config = ConstraintConfig(
        max_constraint_bytes=LARGE,
        constraint_mask_timeout=60,
        constraint_step_items=LLGUIDANCE_STEP_ITEMS,
    )
    grammars = Grammars(tokenizer, len(tokenizer), [], config)
    grammars.prepare()

    def took(constraint: Constraint) -> float:
        started = time.monotonic()
        grammars.compile(constraint)
        return time.monotonic() - started

    return Timing(slow=took(schema("t", SLOW)), quick=max(took(schema("u", QUICK)), 0.001))


def limits(timing: Timing, **settings: Any) -> ConstraintConfig:
    """Large schemas allowed, and a time limit a quarter of a slow compile, and at least 50
    quick ones (a quick compile's verdict also waits for the trio thread to hear of its end,
    which a busy server delays by tens of milliseconds), unless `settings` say otherwise.
    The slow schemas' first mask needs llguidance's own default of Earley items a token
    (`constraint_step_items`): Loom's refuses them as they compile (tests/model/test_grammar.py)."""
    limit = max(timing.slow / 4, 50 * timing.quick)
    if limit > timing.slow / 2:
        pytest.skip(f"slow and quick compiles too close here: {timing}")
    defaults = {
        "constraint_compile_timeout": limit,
        "constraint_mask_timeout": 60,
        "max_constraint_bytes": LARGE,
        "constraint_step_items": LLGUIDANCE_STEP_ITEMS,
    }
    return ConstraintConfig(**{**defaults, **settings})
