"""`python -m specserve.tools.import_cycles`: the import graph's cycles between specserve's modules.

Two counts: with the imports a module makes when it is imported (its top level, not under ``if TYPE_CHECKING``),
and with every import, those inside functions too (a function-level cycle: A imports B at its top and B imports A
inside a function, or both inside functions; it runs, but the two modules are one unit in disguise). A cycle is a
strongly connected set of modules; each is printed with its members. Modules are named as installed
(``gateway/server.py`` is ``specserve.gateway.server``: [tool.setuptools] package-dir). Exit status 0 always: a
count to read, not a gate (import-linter's layers are the gate).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the installed package tree of the checkout at `root` -> its source file."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package, folder in mapping.items():
        for path in (root / folder).rglob("*.py"):
            rel = path.relative_to(root / folder).with_suffix("")
            if "__pycache__" in rel.parts or any(p.startswith(".") for p in rel.parts):
                continue
            parts = [*package.split("."), *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            found.setdefault(".".join(parts), path)
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: set[str], top_only: bool) -> set[str]:
    """The specserve modules `name` imports (at its top level only, or anywhere)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # `import a.b.c` where only a.b is a module: the nearest module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if top_only and isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in child.names:  # `from pkg import mod` imports the module pkg.mod
                    add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
            visit(child)

    visit(tree)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def tree_cycles(root: Path = ROOT, top_only: bool = False) -> list[list[str]]:
    """The import cycles of the checkout at `root` (module-level imports only, or every import)."""
    found = modules(root)
    known = set(found)
    return cycles({name: imports(name, path, known, top_only) for name, path in found.items()})


def main() -> int:
    for label, top_only in (("module-level", True), ("with function-level imports", False)):
        groups = tree_cycles(ROOT, top_only)
        print(f"import cycles, {label}: {len(groups)}")
        for group in groups:
            print("  " + " <-> ".join(group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
