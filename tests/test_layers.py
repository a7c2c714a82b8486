"""The layer contract (pyproject.toml, docs/layers.md) holds, and the check would catch an upward import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = (
    "import sys\n"
    "from importlinter.cli import lint_imports\n"
    "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))\n"
)


def _lint(src: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        env=env,
        cwd=src,
    )


def test_the_package_keeps_its_layer_contract():
    result = _lint(ROOT / "src")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_a_deferred_upward_import_breaks_the_contract(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "kvtrim", src / "kvtrim", ignore=shutil.ignore_patterns("__pycache__", "data"))
    store = src / "kvtrim" / "cache" / "dense.py"
    store.write_text(store.read_text() + "\n\ndef _upward():\n    from ..api import generate\n\n    return generate\n")
    result = _lint(src)
    assert result.returncode != 0
    assert "kvtrim.cache.dense -> kvtrim.api" in result.stdout
