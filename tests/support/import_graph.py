"""The import graph of ``pipeline/``: every ``pipeline.*`` import (top-level or inside a function), its cycles,
and the layers that imports must respect. ``python tests/support/import_graph.py`` prints cycles, upward imports and
module sizes; ``tests/unit/test_layout.py`` asserts there are none. The python files of the committed repositories
(``model_repository/*/*/1/*.py``, the shims tritonserver loads) are in the graph too, on the top floor."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"
REPOSITORIES = PACKAGE.parent / "model_repository"
# Lower floors never import higher ones (STYLE.md 16): the shims tritonserver loads and the CLI on top, then the job
# (its stages, the Ray actor), the code Triton serves (which runs the gpu engine's parts), the engines, the Triton
# process/contract/repositories, and the model/imaging/errors at the bottom. Modules not listed here (the job's own
# modules) sit on the job's floor.
FLOORS = {
    "model_repository": 7,
    "pipeline.cli": 6,
    "pipeline.nightly": 6,
    "pipeline.triton.serve": 4,
    "pipeline.engines": 3,
    "pipeline.triton": 2,
    "pipeline.model": 1,
    "pipeline.default_model": 1,
    "pipeline.imaging": 1,
    "pipeline.spec": 1,
    "pipeline.errors": 0,
    "pipeline.cluster": 0,
}
JOB_FLOOR = 5
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[0] == REPOSITORIES.name:  # a shim: named by its folders (model_repository.gpu.classifier.1.model)
        return ".".join(parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The pipeline modules ``path`` imports anywhere in its body: lazy imports count too, and so does a string that
    names a module (``"pipeline.engines.onnx"``) or a ``"module:attr"`` ref, which ``importlib`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value.partition(":")[0]]
        for name in names:
            if name in modules:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    """module -> the pipeline modules it imports; packages' ``__init__`` only document, so they are not targets."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = {name for name, path in files.items() if path.name != "__init__.py"}
    files.update({module_name(p): p for p in REPOSITORIES.glob("*/*/*/*.py")})
    return {name: imports(path, modules) - {name} for name, path in files.items()}


def floor(module: str) -> int:
    best = None
    for prefix, level in FLOORS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, level)
    return JOB_FLOOR if best is None else best[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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
    """Imports from a lower floor to a higher one."""
    return sorted((a, b) for a, deps in edges.items() for b in deps if floor(b) > floor(a))


def sizes() -> dict[str, int]:
    return {module_name(p): len(p.read_text(encoding="utf-8").splitlines()) for p in PACKAGE.rglob("*.py")}


def main() -> int:
    edges = graph()
    found, up = cycles(edges), upward(edges)
    for component in found:
        print("cycle:", " <-> ".join(component))
    for a, b in up:
        print(f"upward import: {a} (floor {floor(a)}) imports {b} (floor {floor(b)})")
    for name, lines in sorted(sizes().items(), key=lambda kv: -kv[1]):
        if lines > MAX_LINES:
            print(f"over {MAX_LINES} lines: {name} ({lines})")
    print(f"{len(edges)} modules, {sum(map(len, edges.values()))} imports, {len(found)} cycles, {len(up)} upward")
    return 1 if found or up else 0


if __name__ == "__main__":
    sys.exit(main())
