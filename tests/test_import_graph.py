"""The package's module-level imports form no cycle, and `errors.py` is its ground floor.

Read from the source with `ast` (nothing is imported): every `import hybrid_cache...` and
`from hybrid_cache... import` outside a function or class body, `if TYPE_CHECKING:` blocks
included, relative imports resolved. Importing `a.b.c` also runs `a` and `a.b` (their
`__init__`), so those count as imported too, except the importer's own parent packages (Python
has them loaded before it).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import hybrid_cache

PACKAGE_DIR = Path(hybrid_cache.__file__).resolve().parent
PACKAGE = "hybrid_cache"


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (source file, is a package `__init__`)."""
    modules = {}
    files = [
        Path(folder) / name
        for folder, _, names in os.walk(PACKAGE_DIR, followlinks=True)  # kernels/ is a symlink
        for name in names
        if name.endswith(".py")
    ]
    for path in sorted(files):
        parts = [PACKAGE, *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = (path, is_package)
    return modules


def module_level_statements(tree: ast.Module):
    """Every statement not inside a function or class body."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            pending.extend(getattr(node, field, []) or [])


def imported_names(node: ast.stmt, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement may load (a `from m import x` may load `m.x`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source] + [f"{source}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules its module-level code imports."""
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in module_level_statements(tree):
            for name in imported_names(node, module, is_package):
                parts = name.split(".")
                for end in range(1, len(parts) + 1):
                    target = ".".join(parts[:end])
                    own_parent = module.startswith(target + ".")
                    if target in modules and target != module and not own_parent:
                        edges.add(target)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that starts and ends at the same module, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, then "done"
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 40
    # Spot checks that the reader finds absolute, relative and package imports.
    assert "hybrid_cache.config" in graph["hybrid_cache.planner"]
    assert "hybrid_cache.kernels.errors" in graph["hybrid_cache.kernels._launch"]
    assert "hybrid_cache.attention" in graph["hybrid_cache.engine.model_runner"]


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_package_has_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_errors_module_imports_nothing_from_the_package() -> None:
    path, _ = package_modules()["hybrid_cache.errors"]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports = [
        node
        for node in ast.walk(tree)  # anywhere in the file, functions included
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    names = [
        name for node in imports for name in imported_names(node, "hybrid_cache.errors", False)
    ]
    assert not [name for name in names if name == PACKAGE or name.startswith(PACKAGE + ".")]
    assert all(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in imports)


def test_core_errors_are_the_classes_of_the_errors_module() -> None:
    from hybrid_cache import _core, errors

    for name in ("HybridCacheError", "NoFreeBlocksError", "RequestTooLargeError"):
        assert getattr(_core, name) is getattr(errors, name)
        assert getattr(_core, name).__module__ == "hybrid_cache.errors"
