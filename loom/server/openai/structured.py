"""Structured outputs in OpenAI's fields and vLLM's: one `Constraint` (loom/core/constraint.py).

    response_format: {"type": "text"}                      none
                     {"type": "json_object"}               any JSON object
                     {"type": "json_schema",
                      "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    structured_outputs (vLLM's): exactly one of
                     {"json": schema (an object, or its JSON text)}
                     {"regex": "..."}   {"choice": ["a", "b"]}   {"grammar": "Lark text"}
                     {"json_object": true}

Both on one request is refused: a request has one constraint. Taken on completions too, as
vLLM does. Types are checked here, each error naming its field; the constraint itself (its
size, whether it compiles) is the engine's to check.
"""

from __future__ import annotations

import json
from typing import Any

from loom.core.constraint import Constraint, ConstraintKind
from loom.server.openai.errors import invalid

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# JSON nesting a schema may have: llguidance's parser stops at 128 levels of the text with a
# message that names no limit, and Python's own recursion would end deeper ones in a 500.
MAX_SCHEMA_DEPTH = 64


def schema_text(schema: Any, where: str, param: str) -> str:
    """A schema object as JSON text, refused if it nests beyond MAX_SCHEMA_DEPTH."""
    level, layer = 0, [schema]
    while layer:  # breadth first: no recursion of ours
        level += 1
        if level > MAX_SCHEMA_DEPTH:
            raise invalid(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
        layer = [
            child
            for item in layer
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, (dict, list))
        ]
    return json.dumps(schema)


def constraint_of(body: dict[str, Any]) -> Constraint | None:
    formatted = response_format(body.get("response_format"))
    structured = structured_outputs(body.get("structured_outputs"))
    if formatted is not None and structured is not None:
        raise invalid(
            "response_format and structured_outputs cannot both constrain one request",
            "structured_outputs",
        )
    return formatted or structured


def response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(kind=ConstraintKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid(
                "response_format.json_schema must be an object with a schema object",
                "response_format",
            )
        text = schema_text(spec["schema"], "response_format.json_schema.schema", "response_format")
        return Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=text)
    raise invalid(
        "response_format.type must be text, json_object or json_schema", "response_format"
    )


def structured_outputs(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("structured_outputs must be an object", "structured_outputs")
    given = [k for k in STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise invalid(
            f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KEYS)}; "
            f"got {len(given)}",
            "structured_outputs",
        )
    key = given[0]
    item = value[key]
    if key == "json_object":
        if item is not True:
            raise invalid("structured_outputs.json_object must be true", "structured_outputs")
        return Constraint(kind=ConstraintKind.JSON_OBJECT)
    if key == "json":
        if isinstance(item, dict):
            item = schema_text(item, "structured_outputs.json", "structured_outputs")
        elif not isinstance(item, str):
            raise invalid(
                "structured_outputs.json must be a schema object or its JSON text",
                "structured_outputs",
            )
        return Constraint(kind=ConstraintKind.JSON_SCHEMA, spec=item)
    if key == "choice":
        if not isinstance(item, list) or not all(isinstance(c, str) for c in item):
            raise invalid(
                "structured_outputs.choice must be a list of strings", "structured_outputs"
            )
        return Constraint(kind=ConstraintKind.CHOICE, choices=tuple(item))
    kind = ConstraintKind.REGEX if key == "regex" else ConstraintKind.GRAMMAR
    return text_constraint(kind, item, key)


def text_constraint(kind: ConstraintKind, spec: Any, key: str) -> Constraint:
    if not isinstance(spec, str):
        raise invalid(f"structured_outputs.{key} must be a string", "structured_outputs")
    return Constraint(kind=kind, spec=spec)
