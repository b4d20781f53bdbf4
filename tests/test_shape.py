"""The package's shape (the project's style): modules under 300 lines, functions under 50 lines,
argument tables (`add_parser`) and generated code aside."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "loom"
GENERATED = {"v1", "smg"}  # the gRPC code `just proto` makes
ARGUMENT_TABLES = {"add_parser"}


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.parent.name not in GENERATED)


def test_shape_no_module_over_300_lines() -> None:
    long = {str(p): n for p in sources() if (n := len(p.read_text().splitlines())) > 300}
    assert long == {}


def test_shape_no_function_over_50_lines() -> None:
    long = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > 50 and node.name not in ARGUMENT_TABLES:
                    long[f"{path.name}:{node.name}"] = size
    assert long == {}
