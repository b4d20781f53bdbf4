"""Structured outputs: what a request's output must match, checked before it is compiled.

A `Constraint` is plain data: a JSON schema, any JSON object, a regular expression, a Lark
grammar, or a list of choices. The engine compiles it (loom/model/grammar.py) into a
`Matcher` that the request carries: each step masks the request's logits to the tokens the
matcher allows, and each sampled token advances it (`Request.take`). The output ends where the
grammar says it may: EOS is allowed only where the grammar can end, and a grammar that can take
nothing more ends the request at once (finish reason `stop`). A constrained output cut by
`max_tokens` ends with finish reason `length`: the client can tell it is incomplete.
"""

from __future__ import annotations

import enum
from typing import Protocol

import attrs

from loom.core.errors import InvalidRequestError

MAX_CHOICES = 256


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # `spec`: the schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; no `spec`
    REGEX = "regex"  # `spec`: the regular expression (Rust regex syntax)
    GRAMMAR = "grammar"  # `spec`: a Lark grammar, as llguidance reads it, or GBNF
    CHOICE = "choice"  # `choices`: the output is exactly one of them


@attrs.frozen(kw_only=True)
class Constraint:
    kind: ConstraintKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __attrs_post_init__(self) -> None:
        name = self.kind.value
        if self.kind is ConstraintKind.CHOICE:
            if not (1 <= len(self.choices) <= MAX_CHOICES):
                raise InvalidRequestError(
                    f"choice needs 1 to {MAX_CHOICES} choices, got {len(self.choices)}"
                )
            if not all(self.choices):
                raise InvalidRequestError("choice: a choice must not be empty")
            if self.spec:
                raise InvalidRequestError("choice takes no text, only choices")
            return
        if self.choices:
            raise InvalidRequestError(f"{name} takes no choices")
        if (self.kind is ConstraintKind.JSON_OBJECT) != (not self.spec):
            raise InvalidRequestError(
                f"{name} takes no text" if self.spec else f"{name} must not be empty"
            )

    @property
    def size(self) -> int:
        """Its length in UTF-8 bytes (what `max_constraint_bytes` limits)."""
        return len(self.spec.encode(errors="replace")) + sum(
            len(c.encode(errors="replace")) for c in self.choices
        )


class Matcher(Protocol):
    """A compiled constraint's state for one request: the output so far."""

    token_seconds: float  # CPU time its recent tokens cost its grammar, at peak (the mask budget)
    step_seconds: float  # and its last token's: mask and consume (what the fair share charges)

    def consume(self, token_id: int) -> None:
        """Advance by a sampled token (an error state if the grammar refuses it)."""

    def is_stopped(self) -> bool:
        """The grammar can take no more tokens (it is complete, or in error)."""

    def error(self) -> str:
        """Why the matcher failed; empty while it has not."""
