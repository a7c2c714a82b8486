"""No kvtrim module imports a private name (``_x``) from another part of kvtrim.

A part is a subpackage (``kvtrim.cache``, ``kvtrim.eval``, ...) or a top-level module (``kvtrim.api``,
``kvtrim.runtime``, ...); inside a part, modules may share private helpers. Across parts only public names are
used, so a part can change its internals without breaking another one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvtrim

SRC = Path(kvtrim.__file__).resolve().parent


def _module_name(path: Path) -> tuple[str, bool]:
    """``(dotted module name, is a package __init__)`` of a file under the kvtrim source tree."""
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _part(module: str) -> str:
    """``kvtrim.cache.dense`` -> ``kvtrim.cache``; ``kvtrim.api`` -> ``kvtrim.api``; ``kvtrim`` -> ``kvtrim``."""
    return ".".join(module.split(".")[:2])


def _target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(source: str, module: str, is_package: bool) -> list[str]:
    """``"line: from X import _name"`` for every private name ``source`` imports from another kvtrim part."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _target(node, module, is_package)
        if target != "kvtrim" and not target.startswith("kvtrim."):
            continue
        for alias in node.names:
            private = alias.name.startswith("_") and not alias.name.startswith("__")
            # ``from kvtrim import _x`` or ``from kvtrim.cache import _x`` reaches into the named part itself
            owner = _part(f"{target}.{alias.name}") if target == "kvtrim" else _part(target)
            if private and owner != _part(module):
                found.append(f"{node.lineno}: from {target} import {alias.name}")
    return found


def test_no_private_name_is_imported_across_parts():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        module, is_package = _module_name(path)
        for hit in private_imports(path.read_text(encoding="utf-8"), module, is_package):
            offenders.append(f"{path.relative_to(SRC.parent)}:{hit}")
    assert not offenders, "private names imported across kvtrim parts:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("source", "module", "is_package", "expected"),
    [
        ("from ..api import _eos_ids", "kvtrim.serve.engine", False, ["1: from kvtrim.api import _eos_ids"]),
        ("from kvtrim.api import _positions", "kvtrim.eval.fidelity", False, ["1: from kvtrim.api import _positions"]),
        ("from . import _helper", "kvtrim.cache", True, []),  # inside the part
        ("from .dense import _grow", "kvtrim.cache.ragged", False, []),
        ("from .sampling import _check_number", "kvtrim.api", False, ["1: from kvtrim.sampling import _check_number"]),
        ("from .runtime import feed", "kvtrim.api", False, []),
        ("from torch import _C", "kvtrim.api", False, []),  # not kvtrim
        ("from kvtrim import _lazy", "kvtrim.eval.runner", False, ["1: from kvtrim import _lazy"]),
        ("from .. import __version__", "kvtrim.eval.runner", False, []),
    ],
)
def test_the_check_sees_relative_and_absolute_imports(source, module, is_package, expected):
    assert private_imports(source, module, is_package) == expected
