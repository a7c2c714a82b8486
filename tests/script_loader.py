"""Import a script of ``benchmarks/`` or ``tools/`` (folders that are not packages) as a module, for the tests."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """``ROOT/relative`` (e.g. ``"benchmarks/ratio_table.py"``) as the module named by its stem, registered once in
    ``sys.modules`` (which dataclasses and pickling need)."""
    name = pathlib.Path(relative).stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
