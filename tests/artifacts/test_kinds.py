"""The artifact kinds table and the per-kind loaders live below their readers (no calibration import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_model
from kvtrim.artifacts.compresskv import load_compresskv
from kvtrim.artifacts.duo import load_duo_gates
from kvtrim.artifacts.kinds import ARTIFACT_KINDS
from kvtrim.artifacts.store import artifact_command
from kvtrim.errors import MissingArtifactError

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_every_shipped_kind_names_its_calibration_command():
    assert set(ARTIFACT_KINDS) == {
        "headkv", "compresskv", "compilerkv", "duo", "qfilter", "lukv", "kvzap", "fastkvzip",
        "expected_attention_stats", "restorekv",
    }
    for kind in ARTIFACT_KINDS:
        assert artifact_command(kind) == f"kvtrim calibrate {kind} --model <model>"


@pytest.mark.parametrize(("loader", "kind"), [(load_compresskv, "compresskv"), (load_duo_gates, "duo")])
def test_missing_artifact_names_the_command(tmp_path, loader, kind):
    with pytest.raises(MissingArtifactError, match=f"kvtrim calibrate {kind}"):
        loader(tiny_model(), tmp_path / "nothing-here")


def test_readers_of_artifacts_do_not_load_calibration_procedures():
    code = (
        "import sys, kvtrim, kvtrim.methods, kvtrim.api\n"
        "import kvtrim.scoring.head_subset, kvtrim.budgets.error_aware, kvtrim.budgets.duo_heads\n"
        "import kvtrim.scoring.stabilized_utility, kvtrim.selection.threshold\n"
        "print(sorted(m for m in sys.modules if m.startswith(('kvtrim.calibration', 'kvtrim.eval'))))\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "[]"
