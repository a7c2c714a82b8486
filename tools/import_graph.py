"""Print kvtrim's import graph between its rooms (subpackages and top-level modules), its cycles, and the
largest modules.

    PYTHONPATH=src python tools/import_graph.py            # this checkout
    PYTHONPATH=/path/to/other/src python tools/import_graph.py

Every import counts: module-level, deferred (inside functions) and ``if TYPE_CHECKING:`` ones (pass
``--exclude-type-checking`` to leave the last out). The graph comes from grimp, the library import-linter uses.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import grimp

PACKAGE = "kvtrim"


def room(module: str) -> str:
    """``kvtrim.cache.dense`` -> ``cache``; ``kvtrim.api`` -> ``api``; ``kvtrim`` -> ``kvtrim`` (the package
    ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def strongly_connected(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the components with more than one node (each a cycle), largest first."""
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

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(found, key=lambda c: (-len(c), c))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exclude-type-checking", action="store_true", help="ignore `if TYPE_CHECKING:` imports")
    parser.add_argument("--largest", type=int, default=10, help="how many of the largest modules to list")
    args = parser.parse_args(argv)

    graph = grimp.build_graph(PACKAGE, exclude_type_checking_imports=args.exclude_type_checking)
    modules = set(graph.modules)
    module_edges: dict[str, set[str]] = {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}
    room_edges: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for source, targets in module_edges.items():
        for target in targets:
            if room(source) != room(target) and room(target) != PACKAGE:
                room_edges[room(source)][room(target)] += 1

    print(f"# rooms: {len(set(map(room, modules)))}, modules: {len(modules)}")
    print("# room -> rooms it imports (number of module-to-module imports)")
    for source in sorted(room_edges):
        targets = room_edges[source]
        print(f"{source:12s} -> " + ", ".join(f"{t} ({targets[t]})" for t in sorted(targets)))

    room_cycles = strongly_connected(set(room_edges), {s: set(t) for s, t in room_edges.items()})
    print(f"\n# cycles between rooms: {len(room_cycles)}")
    for cycle in room_cycles:
        print("  " + " <-> ".join(cycle))
    module_cycles = strongly_connected(modules, module_edges)
    print(f"\n# cycles between modules: {len(module_cycles)}")
    for cycle in module_cycles:
        print(f"  ({len(cycle)}) " + ", ".join(m.removeprefix(PACKAGE + ".") for m in cycle))

    root = Path(sys.modules[PACKAGE].__file__).parent if PACKAGE in sys.modules else None
    if root is None:
        import importlib

        root = Path(importlib.import_module(PACKAGE).__file__).parent
    sizes = sorted(
        ((sum(1 for _ in p.open(encoding="utf-8")), p.relative_to(root.parent).as_posix()) for p in root.rglob("*.py")),
        reverse=True,
    )
    print(f"\n# largest modules (lines), of {len(sizes)} files, {sum(n for n, _ in sizes)} lines in all")
    for lines, path in sizes[: args.largest]:
        print(f"{lines:6d}  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
