"""The package's layers, held by its imports: core < model < engine < server < bench and CLI;
the clients (`loom.client`) stand beside the server, apart from it and from the engine, on the
generated `loom.v1` alone.

Each module may import only modules of its own layer or of the layers below; `loom.core`
imports neither torch nor trio (nor anything that does), and each layer keeps out the libraries
of the layers above it. No modules import each other in a circle (type-only imports count).

Inside the server, the fronts (`loom.server.grpc`, `loom.server.openai`, and
`loom.server.vllm`, the vLLM engine protocol, which rides the gRPC front's transport: `RIDES`)
stand side by side: none imports another, and what they share (`loom.server`'s own modules)
imports none; only the modules that put the server together (`ASSEMBLY`) import them all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "loom"
GENERATED = {"v1", "smg"}  # the gRPC code `just proto` makes
LAYERS = {
    "core": 0,
    "model": 1,
    "engine": 2,
    "server": 3,
    "v1": 3,
    "smg": 3,
    "client": 3,
    "bench": 4,
    "chaos": 4,
    "cli": 4,
    "entry_point": 4,
}
FRONTS = ("loom.server.grpc", "loom.server.openai", "loom.server.vllm")
RIDES = {"loom.server.vllm": "loom.server.grpc"}  # a protocol, on another front's transport
APART = {"client": {"core", "model", "engine", "server"}, "server": {"client"}}  # and the reverse
ASSEMBLY = {
    "loom.server.io_thread",
    "loom.server.config",
    "loom.server.drain",
    "loom.server.supervisor",
}
# Third-party packages that belong to a higher layer than the key's.
FORBIDDEN = {
    "core": {"torch", "trio", "grpclib", "asyncio", "transformers", "google"},
    "model": {"trio", "grpclib", "asyncio"},
    "engine": {"grpclib", "asyncio"},
}


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.parent.name not in GENERATED)


def layer_of(dotted: str) -> str | None:
    """`loom.engine.admission` -> "engine"; None for `loom` itself and `loom.__main__`."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def imports_of(path: Path, *, members: bool = False) -> set[str]:
    """The modules `path` imports, anywhere in it (type-only imports too); with `members`,
    `from package import name` also as `package.name` (a module, when it is one)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if members:
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def all_imports_of(path: Path) -> set[str]:
    """Every `loom` module `path` imports."""
    return {name for name in imports_of(path, members=True) if name in MODULES}


def dotted_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts).removesuffix(".__init__")


MODULES = {dotted_name(p): p for p in modules()}


def front_of(dotted: str) -> str | None:
    return next((f for f in FRONTS if dotted == f or dotted.startswith(f + ".")), None)


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
    apart = [name for name in imports_of(path) if layer_of(name) in APART.get(own, set())]
    assert apart == [], f"{dotted_name(path)} ({own}) imports {apart}"
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


@pytest.mark.parametrize(
    "path", [p for p in modules() if dotted_name(p).startswith("loom.server")], ids=dotted_name
)
def test_layers_the_fronts_stand_side_by_side(path: Path) -> None:
    own = dotted_name(path)
    if own in ASSEMBLY:
        return
    mine = front_of(own)
    allowed = {mine, RIDES.get(mine or "")}
    others = sorted(
        name for name in all_imports_of(path) if (front := front_of(name)) and front not in allowed
    )
    assert others == [], f"{own} imports a front not its own: {others}"


def test_layers_no_modules_import_each_other_in_a_circle() -> None:
    graph = {name: all_imports_of(path) - {name} for name, path in MODULES.items()}
    circles = [sorted(c) for c in strongly_connected(graph) if len(c) > 1]
    assert circles == []


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                found.append(component)
    return found
