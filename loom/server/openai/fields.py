"""Reading an OpenAI request body's fields: each checked to be of its type, each error a 400
naming the field (loom/server/openai/errors.py)."""

from __future__ import annotations

from typing import Any

from loom.server.openai.errors import invalid


def json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None)
    return body


def optional(body: dict[str, Any], field: str, kind: type) -> Any:
    """`body[field]` if given (null counts as not given), checked to be of `kind`."""
    value = body.get(field)
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise invalid(f"{field} is beyond any float's range", field) from None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise invalid(f"{field} must be {KINDS[kind]}, got {type(value).__name__}", field)
    return value


KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def present(body: dict[str, Any], *fields: str, kind: type) -> dict[str, Any]:
    return {f: v for f in fields if (v := optional(body, f, kind)) is not None}


def int_list(value: Any, field: str, limit: int) -> list[int]:
    """A list of at most `limit` integers (counted before each is looked at: a 4 MiB body
    holds two million)."""
    if isinstance(value, list) and len(value) > limit:
        raise invalid(f"{field} has {len(value)} items; the limit is {limit}", field)
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise invalid(f"{field} must be a list of integers", field)
    return value
