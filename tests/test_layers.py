"""The package's layers, held by its imports: core < model < engine < server < bench and CLI.

Each module may import only modules of its own layer or of the layers below; `loom.core`
imports neither torch nor trio (nor anything that does), and each layer keeps out the libraries
of the layers above it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "loom"
LAYERS = {
    "core": 0,
    "model": 1,
    "engine": 2,
    "server": 3,
    "v1": 3,
    "bench": 4,
    "chaos": 4,
    "cli": 4,
    "entry_point": 4,
}
# Third-party packages that belong to a higher layer than the key's.
FORBIDDEN = {
    "core": {"torch", "trio", "grpclib", "asyncio", "transformers", "google"},
    "model": {"trio", "grpclib", "asyncio"},
    "engine": {"grpclib", "asyncio"},
}


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.parent.name != "v1")


def layer_of(dotted: str) -> str | None:
    """`loom.engine.admission` -> "engine"; None for `loom` itself and `loom.__main__`."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def dotted_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts).removesuffix(".__init__")


@pytest.mark.parametrize("path", modules(), ids=lambda p: dotted_name(p))
def test_layers_a_module_imports_no_higher_layer(path: Path) -> None:
    own = layer_of(dotted_name(path))
    if own is None:
        return
    higher = [
        name
        for name in imports_of(path)
        if name.startswith("loom.") and (layer := layer_of(name)) and LAYERS[layer] > LAYERS[own]
    ]
    assert higher == [], f"{dotted_name(path)} ({own}) imports a higher layer: {higher}"
    banned = FORBIDDEN.get(own, set())
    third_party = [name for name in imports_of(path) if name.split(".")[0] in banned]
    assert third_party == [], f"{dotted_name(path)} ({own}) imports {third_party}"


def test_layers_importing_all_of_the_core_loads_neither_torch_nor_trio() -> None:
    core = [dotted_name(p) for p in modules() if layer_of(dotted_name(p)) == "core"]
    assert "loom.core.scheduler" in core
    script = (
        "import importlib, sys\n"
        f"for name in {core!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'trio', 'grpclib', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
