"""The import structure of the product, drawn from its source: which folder imports which.

Prints the top-level folders of appliance/ (and tui/) with the docstring line of each, then
counts of cross-folder imports, folder pairs importing each other (cycles between folders)
and the longer folder cycles. tests/test_layers.py holds the rules on the same graph.

    .venv/bin/python benchmarks/import_structure.py [--edges]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    """Every module of appliance/ and tui/, by dotted name."""
    return {
        module_name(p): p
        for top in ("appliance", "tui")
        for p in sorted((ROOT / top).rglob("*.py"))
    }


def imports_of(path: Path, known: dict[str, Path]) -> Iterator[tuple[str, bool]]:
    """The product modules `path` imports, each with whether the import runs when the module
    loads (False: inside a function, or under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    lazy_nodes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lazy_nodes.update(id(n) for n in ast.walk(node) if n is not node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lazy_nodes.update(id(n) for b in node.body for n in ast.walk(b))
    for node in ast.walk(tree):
        eager = id(node) not in lazy_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _resolve(alias.name, known, eager)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known:
                    yield target, eager
                else:
                    yield from _resolve(base, known, eager)


def _resolve(name: str, known: dict[str, Path], eager: bool) -> Iterator[tuple[str, bool]]:
    while name and name not in known:
        name = name.rpartition(".")[0]
    if name:
        yield name, eager


def folder_of(module: str) -> str:
    """appliance.pools.supervisor -> appliance/pools; appliance.api -> appliance/api.py."""
    parts = module.split(".")
    if parts[0] == "tui":
        return "tui"
    if len(parts) == 2:
        return (
            f"appliance/{parts[1]}.py"
            if not (ROOT / "appliance" / parts[1]).is_dir()
            else f"appliance/{parts[1]}"
        )
    return "/".join(parts[:2]) if len(parts) > 1 else parts[0]


def graph(eager_only: bool = False) -> dict[str, set[str]]:
    """Module -> the product modules it imports."""
    known = product_modules()
    return {
        name: {t for t, eager in imports_of(path, known) if (eager or not eager_only) and t != name}
        for name, path in known.items()
    }


def folder_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = defaultdict(set)
    for name, targets in modules.items():
        folders[folder_of(name)]
        for target in targets:
            if folder_of(target) != folder_of(name):
                folders[folder_of(name)].add(folder_of(target))
    return dict(folders)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one folder (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def describe(folder: str) -> str:
    path = ROOT / folder
    doc_file = path / "__init__.py" if path.is_dir() else path
    if doc_file.is_file():
        doc = ast.get_docstring(ast.parse(doc_file.read_text(encoding="utf-8")))
        if doc:
            return doc.split("\n")[0]
    return "(no docstring)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", action="store_true", help="list every folder edge")
    args = parser.parse_args()
    modules = graph()
    folders = folder_graph(modules)
    print("## Top-level parts\n")
    for folder in sorted(folders):
        print(f"- `{folder}`: {describe(folder)}")
    cross = sum(1 for n, ts in modules.items() for t in ts if folder_of(t) != folder_of(n))
    pairs = sorted(
        {
            tuple(sorted((a, b)))
            for a, bs in folders.items()
            for b in bs
            if a in folders.get(b, set())
        }
    )
    groups = cycles(folders)
    print("\n## Counts\n")
    loose = sum(1 for f in folders if f.endswith(".py"))
    edges = sum(len(v) for v in folders.values())
    largest = max((len(g) for g in groups), default=0)
    print(f"- modules: {len(modules)}; top-level parts: {len(folders)}; loose modules: {loose}")
    print(f"- cross-folder imports (module to module): {cross}; folder edges: {edges}")
    print(f"- folder pairs importing each other: {len(pairs)}")
    print(f"- folder cycles (strongly connected groups): {len(groups)}, largest {largest}")
    for group in groups:
        print(f"  - {', '.join(group)}")
    if args.edges:
        print("\n## Edges\n")
        for folder in sorted(folders):
            print(f"- {folder} -> {', '.join(sorted(folders[folder]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
