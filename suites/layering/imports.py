"""The project's import graph, read from the source (no module is imported), its circles and the
imports that run up the layers.

Every ``import`` and ``from ... import`` counts, wherever it is written: at the top, under
``if TYPE_CHECKING:``, inside a function. ``from package import name`` counts as an import of
``package.name`` where that is a module of the tree, else of ``package``.
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = [
    "FRONT_END_PACKAGES",
    "LAYERS",
    "STAGES",
    "backward_stage_imports",
    "find_cycles",
    "import_graph",
    "layer_of",
    "module_name",
    "stage_of",
    "unstaged_library_modules",
    "upward_imports",
]

#: the layers, lowest first: a module may import its own layer and the layers below it. The
#: harness library is ``harness`` without its front ends (the command line, the pytest plugin, the
#: conformance tests shipped in the package and ``python -m harness``), which sit above the reports
#: they print.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine", ("engine",)),
    ("harness library", ("harness",)),
    ("reports", ("reports",)),
    ("front ends", ("harness.cli", "harness.pytest_plugin", "harness.conformance", "harness.__main__")),
    ("suites", ("suites",)),
)

#: the sub-packages of the harness library, one per stage a case goes through, in that order: a stage's
#: modules import their own stage and earlier ones only. A case is described (``cases``: its config, the
#: zoo, its record's vocabulary), gets ranks (``ranks``) and engines to train (``engines``: adapters,
#: references, the registry), is selected over the registered engines (``selection``), trained on both
#: sides and judged (``compare``), recorded (``collect``); ``run`` is the case loop every front end shares,
#: and ``perf`` the benchmark on the same ranks and engines. ``harness/__init__.py`` above them re-exports
#: the plug-in authors' names, lazily; no stage imports it.
STAGES: tuple[str, ...] = ("cases", "ranks", "engines", "selection", "compare", "collect", "run", "perf")
#: the packages of ``harness/`` that are front ends, not stages.
FRONT_END_PACKAGES: tuple[str, ...] = ("cli", "pytest_plugin", "conformance")


def module_name(root: Path, path: Path) -> str:
    """``engine/unit.py`` -> ``engine.unit``; ``engine/__init__.py`` -> ``engine``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(current: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """``module -> modules of the tree it imports`` for every module under ``root/<package>``."""
    files = {module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                # ``import a.b.c`` depends on the deepest module of the tree it names.
                parts = target.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                if parts and ".".join(parts) != name:
                    edges.add(".".join(parts))
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module
    (Tarjan's algorithm), each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=lambda c: (-len(c), c))


def layer_of(module: str) -> int | None:
    """Index in :data:`LAYERS` of ``module``'s layer (the longest matching prefix wins); None outside them."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` for every import of ``graph`` from a lower layer into a higher one, sorted."""
    found = []
    for module, targets in graph.items():
        low = layer_of(module)
        for target in targets:
            high = layer_of(target)
            if low is not None and high is not None and high > low:
                found.append((module, target))
    return sorted(found)


def stage_of(module: str) -> int | None:
    """Index in :data:`STAGES` of ``module``'s stage (``harness.<stage>`` or below it); None outside them."""
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[0] == "harness" and parts[1] in STAGES else None


def backward_stage_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` for every import of a stage module from a later stage or from the ``harness``
    package itself (the facade that re-exports the stages), sorted."""
    found = []
    for module, targets in graph.items():
        own = stage_of(module)
        if own is None:
            continue
        for target in targets:
            other = stage_of(target)
            if target == "harness" or (other is not None and other > own):
                found.append((module, target))
    return sorted(found)


def unstaged_library_modules(root: Path) -> list[str]:
    """Paths of the Python files and packages directly in ``root/harness`` that are neither a stage, a front
    end, ``__init__.py`` nor ``__main__.py``: every library module sits in its stage."""
    found = []
    for path in sorted((root / "harness").iterdir()):
        if path.is_dir() and (path / "__init__.py").exists():
            if path.name not in STAGES and path.name not in FRONT_END_PACKAGES:
                found.append(path.relative_to(root).as_posix())
        elif path.suffix == ".py" and path.name not in ("__init__.py", "__main__.py"):
            found.append(path.relative_to(root).as_posix())
    return found
