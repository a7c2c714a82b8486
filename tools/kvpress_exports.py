"""Write the list of a kvpress wheel's exports as JSON (the data the kvpress mapping table is checked against).

Usage: ``python tools/kvpress_exports.py kvpress-0.5.5-py3-none-any.whl > src/kvtrim/data/kvpress_exports.json``
(the wheel from ``pip download --no-deps kvpress==0.5.5``). Reads ``kvpress/__init__.py``'s ``__all__`` without
importing kvpress, and sorts each name into presses (classes defined under ``kvpress/presses`` that derive from
a press, abstract bases excepted), base classes and the rest.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile

BASES = ("BasePress", "ScorerPress", "ComposedPress")


def exports(wheel: str) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        init = archive.read("kvpress/__init__.py").decode()
        version = re.search(r"kvpress-([^-]+)-", wheel.rsplit("/", 1)[-1]).group(1)
    tree = ast.parse(init)
    names: list[str] = []
    sources: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = [ast.literal_eval(element) for element in node.value.elts]
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                sources[alias.asname or alias.name] = node.module
    presses = sorted(n for n in names if n not in BASES and sources[n].startswith("kvpress.presses."))
    other = sorted(n for n in names if n not in BASES and n not in presses)
    return {"package": "kvpress", "version": version, "presses": presses, "bases": sorted(BASES), "other": other}


if __name__ == "__main__":
    json.dump(exports(sys.argv[1]), sys.stdout, indent=1)
    sys.stdout.write("\n")
