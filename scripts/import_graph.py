"""sprig's import graph, read from the source (nothing is imported): each module's sprig
imports, its cycles, and what a module reaches.

An edge a -> b is an import of b anywhere in a, at module level or inside a function (a
lazy import is still a dependency), except under `if TYPE_CHECKING:`. `from pkg import
name` is an edge to the submodule `pkg.name` when there is one, else to `pkg`.

    python scripts/import_graph.py                 # the cycles (none: exit 0)
    python scripts/import_graph.py --edges         # every module's imports
    python scripts/import_graph.py --reach MODULE  # every module MODULE depends on
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"lang": "sprig", "runtime": "sprig.runtime", "radix": "sprig.radix", "kernels": "sprig.kernels"}
Graph = dict[str, set[str]]


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the four packages by dotted name."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                subs = {f"{base}.{alias.name}" for alias in node.names} & known.keys()
                found.update(subs)
                if len(subs) < len(node.names):
                    found.add(base)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    visit([child])

    visit(ast.parse(path.read_text()).body)
    edges = set()
    for target in found:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def graph(root: Path = ROOT) -> Graph:
    """Each module -> the sprig modules it imports."""
    known = modules(root)
    return {name: _imported(name, path, known) for name, path in known.items()}


def cycles(g: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in g:
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(g[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def reach(g: Graph, start: str) -> set[str]:
    """Every module `start` depends on, directly or not."""
    seen, todo = set(), [start]
    while todo:
        for nxt in g[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edges", action="store_true", help="print every module's imports")
    parser.add_argument("--reach", metavar="MODULE", help="print every module MODULE depends on")
    args = parser.parse_args()
    g = graph()
    if args.edges:
        for name in sorted(g):
            print(name, "->", ", ".join(sorted(g[name])) or "-")
    if args.reach:
        print("\n".join(sorted(reach(g, args.reach))))
    found = cycles(g)
    for component in found:
        print("cycle:", " <-> ".join(component))
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports, {len(found)} cycles")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
