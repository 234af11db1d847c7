"""The import graph of ``pipeline/`` by room, and the floors the rooms stand on.

A room is a package folder of ``pipeline/`` (``pipeline.io``), its sub-packages included (``pipeline.triton.serve`` is
in ``pipeline.triton``), or a top-level module (``pipeline.cli``); the shims tritonserver loads
(``model_repository/*/*/1/*.py``) are one room on the top floor.
Every ``pipeline.*`` import counts, at the top of a module or inside a function, and so does a string that names a
module (``"pipeline.engines.onnx"``) or a ``"module:attr"`` ref, which ``importlib`` imports.

``python tests/support/import_graph.py`` prints the room graph, the longest chain of room imports and anything that
breaks the floors; ``tests/unit/test_layout.py`` asserts there is nothing.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"
SHIMS = "model_repository"
# Each room's floor (docs/architecture.md): a room imports rooms on its own floor or lower, never higher, and a room
# that is not listed here fails the check until it is given a floor.
FLOORS = {
    "pipeline.errors": 0,
    "pipeline.schema": 1,
    "pipeline.columns": 1,
    "pipeline.node": 1,
    "pipeline.terminal": 1,
    "pipeline.text": 1,
    "pipeline.storage": 2,
    "pipeline.io": 3,
    "pipeline.model": 3,
    "pipeline.quality": 4,
    "pipeline.int8": 4,
    "pipeline.metrics": 4,
    "pipeline.sizing": 4,
    "pipeline.gpu": 4,
    "pipeline.triton": 5,
    "pipeline.engines": 6,
    "pipeline.actor": 7,
    "pipeline.model_check": 7,
    "pipeline.model_import": 8,
    "pipeline.config": 8,
    "pipeline.job": 9,
    "pipeline.nightly": 10,
    "pipeline.api": 10,
    "pipeline.cli": 11,
    SHIMS: 12,
}
# The longest chain of room imports allowed (a list -> fetch -> classify -> write job included).
MAX_CHAIN = 9


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    if parts[0] == SHIMS:  # a shim: named by its folders (model_repository.gpu.classifier.1.model)
        return ".".join(parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str], packages: frozenset[str] = frozenset()) -> set[str]:
    """The pipeline modules ``path`` imports anywhere in its body: lazy imports count too, and so does a string that
    names a module (``"pipeline.engines.onnx"``) or a ``"module:attr"`` ref, which ``importlib`` imports. A string that
    names a package is a name (where the repositories' shims import from), not an import."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value.partition(":")[0]]
            names = [n for n in names if n not in packages]
        for name in names:
            if name in modules:
                found.add(name)
    return found


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the pipeline modules it imports (the shims' too); a package counts as a module (its ``__init__``)."""
    files = {module_name(p, package): p for p in package.rglob("*.py")}
    modules = set(files)
    packages = frozenset(name for name, path in files.items() if path.name == "__init__.py")
    files.update({module_name(p, package): p for p in (package.parent / SHIMS).glob("*/*/*/*.py")})
    return {name: imports(path, modules, packages) - {name} for name, path in files.items()}


def room(module: str) -> str:
    """The package folder of ``pipeline/`` that holds ``module``, at any depth (``pipeline.triton.serve.backend`` is in
    ``pipeline.triton``), or the top-level module itself: the first two parts of its name."""
    if module.split(".")[0] == SHIMS:
        return SHIMS
    return ".".join(module.split(".")[:2])


def rooms(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """room -> the other rooms its modules import."""
    out: dict[str, set[str]] = {}
    for a, deps in edges.items():
        if a == PACKAGE.name:  # pipeline/__init__.py: the version
            continue
        out.setdefault(room(a), set()).update(room(b) for b in deps if b != PACKAGE.name)
    return {r: deps - {r} for r, deps in out.items()}


def floor(module_or_room: str) -> int | None:
    return FLOORS.get(room(module_or_room))


def unplaced(edges: dict[str, set[str]]) -> list[str]:
    """Modules whose room has no floor."""
    return sorted(m for m in edges if m != PACKAGE.name and floor(m) is None)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower floor to a higher one (modules whose room has no floor are ``unplaced``)."""
    return sorted((a, b) for a, deps in edges.items() for b in deps
                  if floor(a) is not None and floor(b) is not None and floor(b) > floor(a))


def longest_chain(room_edges: dict[str, set[str]]) -> list[str]:
    """The longest chain of room imports (the room graph must have no cycle)."""
    best: dict[str, list[str]] = {}

    def chain(r: str) -> list[str]:
        if r not in best:
            best[r] = [r] + max((chain(d) for d in sorted(room_edges.get(r, ()))), key=len, default=[])
        return best[r]

    return max((chain(r) for r in sorted(room_edges)), key=len, default=[])


def problems(edges: dict[str, set[str]]) -> list[str]:
    """Everything that breaks the floors, one line each; empty when the layout holds."""
    found = [f"no floor: {m} (its room {room(m)} is not in FLOORS)" for m in unplaced(edges)]
    found += [f"upward import: {a} (floor {floor(a)}) imports {b} (floor {floor(b)})" for a, b in upward(edges)]
    room_edges = rooms(edges)
    room_cycles = cycles(room_edges)
    found += ["room cycle: " + " <-> ".join(c) for c in room_cycles]
    found += ["module cycle: " + " <-> ".join(c) for c in cycles(edges)]
    if not room_cycles:
        chain = longest_chain(room_edges)
        if len(chain) > MAX_CHAIN:
            found.append(f"chain of {len(chain)} rooms (at most {MAX_CHAIN}): " + " -> ".join(chain))
    return found


def main() -> int:
    edges = graph()
    room_edges = rooms(edges)
    for r in sorted(room_edges, key=lambda r: (FLOORS.get(r, -1), r)):
        print(f"{FLOORS.get(r, '?'):>2} {r} -> {', '.join(sorted(room_edges[r], key=lambda d: (-FLOORS.get(d, -1), d)))}")
    found = problems(edges)
    if not cycles(room_edges):
        chain = longest_chain(room_edges)
        print(f"longest chain ({len(chain)} rooms): {' -> '.join(chain)}")
    for line in found:
        print(line)
    print(f"{len(edges)} modules in {len(room_edges)} rooms, {sum(map(len, edges.values()))} imports, "
          f"{len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
