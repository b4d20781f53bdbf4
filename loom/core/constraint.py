"""Structured outputs: what a request's output must match, checked before it is compiled.

A `Constraint` is plain data: a JSON schema, any JSON object, a regular expression, a Lark
grammar, or a list of choices. The engine compiles it (loom/model/grammar.py) into a
`Matcher` that the request carries: each step masks the request's logits to the tokens the
matcher allows, and each sampled token advances it (`Request.take`); with a reasoning parser,
from the token after the thinking ends (`Thinking`). The output ends where the
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
# The reasoning parsers a constraint can wait for, and whether the model opens its thinking
# itself (qwen3: an answer may open with `<think>`) or the chat template does (deepseek_r1).
THINKING_OPENS = {"qwen3": True, "deepseek_r1": False}


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
    # A reasoning model's (the server's --reasoning-parser: qwen3, deepseek_r1): the
    # constraint binds the answer after the thinking ends (`Thinking`), as vLLM's does.
    reasoning: str | None = None

    def __attrs_post_init__(self) -> None:
        name = self.kind.value
        if self.reasoning not in (None, *THINKING_OPENS):
            raise InvalidRequestError(f"reasoning must be one of {', '.join(THINKING_OPENS)}")
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


@attrs.frozen(kw_only=True)
class Thinking:
    """A reasoning model's markers, for a constraint that waits for the thinking to end: the
    ids of `</think>` and `<think>` (None if it is not one token), and whether the model
    opens its thinking itself (qwen3) or its chat template does (deepseek_r1)."""

    end: int
    start: int | None
    model_opens: bool

    def last_marker(self, prompt: tuple[int, ...]) -> int | None:
        """The prompt's last marker: `end`, the template has closed the thinking (thinking
        off: the constraint binds at once, vLLM's rule); `start`, it has opened it (the model
        thinks first, whoever usually opens it); None for neither."""
        for token_id in reversed(prompt):
            if token_id == self.end or token_id == self.start:
                return token_id
        return None


class Matcher(Protocol):
    """A compiled constraint's state for one request: the output so far."""

    token_seconds: float  # CPU time its recent tokens cost its grammar, at peak (the mask budget)
    step_seconds: float  # and its last token's: mask and consume (what the fair share charges)
    opening: int | None  # a token its first mask allows beside the grammar's (qwen3's <think>)

    def consume(self, token_id: int) -> None:
        """Advance by a sampled token (an error state if the grammar refuses it)."""

    def is_stopped(self) -> bool:
        """The grammar can take no more tokens (it is complete, or in error)."""

    def error(self) -> str:
        """Why the matcher failed; empty while it has not."""
