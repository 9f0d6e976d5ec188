"""The package's shape: no import cycle at module level, and no folder over 15 modules.

The one-directional layering itself is checked by ``lint-imports`` (``[tool.importlinter]`` in pyproject.toml).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "winsp"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """winsp modules imported when ``path`` is imported (module body only; ``TYPE_CHECKING`` blocks skipped)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            body.extend(node.body + getattr(node, "orelse", []) + [s for h in getattr(node, "handlers", []) for s in h.body])
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found.update(name for name in names if name in modules)
    return found


def test_no_module_level_import_cycle():
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    edges = {name: _top_level_imports(path, set(paths)) - {name} for name, path in paths.items()}
    # importing a package's __init__ is what a submodule import triggers; the package's own re-exports are not a cycle
    for name in edges:
        edges[name] = {dep for dep in edges[name] if not name.startswith(dep + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(edges[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("module-level import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name)


def test_no_folder_over_15_modules():
    for folder in [ROOT, *[p for p in ROOT.rglob("*") if p.is_dir() and p.name != "__pycache__"]]:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 15, f"{folder}: {len(modules)} modules"
