"""CriticalKV perturbation analysis on a tiny model."""

from __future__ import annotations

import json

from conftest import random_text, tiny_model
from kvtrim.analysis.perturbation import perturbation_analysis, write_report


def test_analysis_shapes_fractions_and_files(tokenizer, tmp_path):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    text = random_text(400, seed=9)
    report = perturbation_analysis(
        model, tokenizer, budgets=[12, 24], prompts=2, context_tokens=80, queries=4, text=text
    )
    for method in ("snapkv", "critical_snapkv"):
        for b in (12, 24):
            assert tuple(report.head_l1[method][b].shape) == (2, 4)
            assert tuple(report.layer_l1[method][b].shape) == (2,)
            assert bool((report.head_l1[method][b] > 0).all())
        # a larger budget perturbs less
        assert float(report.layer_l1[method][24].mean()) < float(report.layer_l1[method][12].mean())
    assert all(0.0 <= f <= 1.0 for f in report.fraction_improved.values())
    files = write_report(report, tmp_path)
    assert all(f.exists() for f in files)
    data = json.loads((tmp_path / "perturbation.json").read_text())
    assert set(data["fraction_improved"]) == {"12", "24"}
    assert "heads improved" in (tmp_path / "perturbation.md").read_text()
