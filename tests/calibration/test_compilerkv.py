"""CompilerKV's compiled tables: artifact round trip, lookups, errors, and a small end-to-end compilation."""

from __future__ import annotations

import json

import pytest
import torch

import kvtrim
from conftest import install_compilerkv_tables, tiny_model
from kvtrim.artifacts.compilerkv import (
    HEAD_ACTIONS,
    THRESHOLD_ACTIONS,
    CompiledTables,
    TableSource,
    load_compilerkv,
)
from kvtrim.calibration.compilerkv import CompilerKVCalibration, _balanced_actions, calibrate_compilerkv
from kvtrim.calibration.cql import CQLSettings
from kvtrim.errors import InvalidParameterError, MissingArtifactError


def test_action_grids_follow_the_spec():
    assert len(HEAD_ACTIONS) == 29 and float(HEAD_ACTIONS[0]) == pytest.approx(0.8)
    assert float(HEAD_ACTIONS[-1]) == pytest.approx(1.5)
    assert float(HEAD_ACTIONS[1] - HEAD_ACTIONS[0]) == pytest.approx(0.025)
    assert len(THRESHOLD_ACTIONS) == 21 and float(THRESHOLD_ACTIONS[-1]) == pytest.approx(1.0)


def test_artifact_round_trip(tmp_path):
    model = tiny_model("llama", layers=3)
    path = install_compilerkv_tables(model, directory=tmp_path, seed=3)
    again = load_compilerkv(model, str(path))
    assert again.budgets == [20, 40]
    assert again.head_weights.shape == (2, 3, 4) and again.thresholds.shape == (2, 3, 4, 2)
    assert float(again.head_weights.min()) >= 0.8 - 1e-6 and float(again.head_weights.max()) <= 1.5 + 1e-6
    tensors = again.tensors()
    rebuilt = CompiledTables.from_tensors(tensors)
    for name, value in rebuilt.tensors().items():
        assert torch.equal(value, tensors[name]), name


def test_missing_artifact_names_the_command(monkeypatch, tmp_path, llama, tokenizer):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    with pytest.raises(MissingArtifactError, match="kvtrim calibrate compilerkv"):
        kvtrim.generate(llama, tokenizer, "some context " * 10, "q?", method="compilerkv", budget=20)
    # the neutral ablation needs nothing, and is only reachable by its own name
    kvtrim.generate(llama, tokenizer, "some context " * 10, "q?", method="compilerkv_neutral", budget=20)


def test_nearest_budget_is_used_and_reported_unless_exact(monkeypatch, tmp_path, llama, tokenizer):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    install_compilerkv_tables(llama)  # budgets 20 and 40
    text = "the quick brown fox jumps over the lazy dog. " * 8
    result = kvtrim.generate(llama, tokenizer, text, "what?", method="compilerkv", budget=33, max_new_tokens=2)
    meta = result.stats.compression_metadata
    assert meta["compilerkv_requested_budget"] == [33] and meta["compilerkv_compiled_budget"] == [40]
    assert result.stats.kv_entries_after == 33 * 2 * len(llama.model.layers)
    with pytest.raises(InvalidParameterError, match="not compiled"):
        kvtrim.generate(
            llama, tokenizer, text, "what?", method="compilerkv", budget=33, method_params={"exact_budget": True}
        )
    tables = TableSource(tables=load_compilerkv(llama))
    assert tables.tables.budget_index(30) == 0  # ties go to the smaller budget


def test_nothing_evicted_is_exact(monkeypatch, tmp_path, llama, tokenizer):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    install_compilerkv_tables(llama)
    text = "alpha beta gamma delta " * 5
    full = kvtrim.generate(llama, tokenizer, text, "next?", method=None, max_new_tokens=8)
    for method in ("compilerkv", "compilerkv_elastic", "compilerkv_neutral"):
        out = kvtrim.generate(llama, tokenizer, text, "next?", method=method, budget=10_000, max_new_tokens=8)
        assert out.answers == full.answers
        assert out.stats.kv_entries_after == out.stats.kv_entries_before


def test_balanced_logging_design():
    plan = _balanced_actions(5, 58, 29, torch.Generator().manual_seed(0))
    for row in plan:
        assert torch.bincount(row, minlength=29).tolist() == [2] * 29


def test_settings_are_checked():
    with pytest.raises(InvalidParameterError, match="documents"):
        CompilerKVCalibration(documents=0)
    with pytest.raises(InvalidParameterError, match="prompt_tokens"):
        CompilerKVCalibration(budgets=(64, 2000), prompt_tokens=1000)


def test_small_compilation_end_to_end(tmp_path, tokenizer):
    model = tiny_model("llama", layers=2)
    settings = CompilerKVCalibration(
        budgets=(16, 24),
        documents=3,
        prompt_tokens=48,
        continuation_tokens=8,
        head_rollouts=2,
        gate_rollouts=2,
        window=8,
        entropy_bins=3,
        ppl_bins=2,
        cql=CQLSettings(epochs=5),
    )
    path = calibrate_compilerkv(model, tokenizer, settings, out_dir=tmp_path, progress=False)
    tables = load_compilerkv(model, str(path))
    assert tables.budgets == [16, 24]
    assert tables.head_weights.shape == (2, 2, 4) and tables.thresholds.shape == (2, 2, 3, 2)
    assert len(tables.entropy_edges) == 2 and len(tables.ppl_edges) == 1
    # every head state saw 3 documents × 2 rollouts; gate states only where documents fell
    assert tables.head_support.eq(6).all()
    assert int(tables.gate_support.sum()) == 2 * 2 * 3 * 2  # budgets × layers × documents × rollouts
    on_grid = (tables.head_weights[..., None] - HEAD_ACTIONS).abs().amin(-1)
    assert float(on_grid.max()) < 1e-6
    assert bool(((tables.thresholds >= 0.8 - 1e-6) & (tables.thresholds <= 1.0 + 1e-6)).all())
    assert bool((tables.thresholds[tables.gate_support == 0] == 0.8).all())  # unvisited: the lowest threshold
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["settings"]["budgets"] == [16, 24] and len(meta["corpus_checksum_sha256"]) == 64
    assert meta["history"][0]["head_rollouts"] == 2 * 3 * 2 and meta["history"][0]["head_records"] == 12 * 2 * 4
    assert meta["cpu_seconds"] > 0


def test_policy_plots(tmp_path):
    from kvtrim.artifacts.compilerkv import plot_compilerkv

    model = tiny_model("llama", layers=3)
    tables = load_compilerkv(model, str(install_compilerkv_tables(model, directory=tmp_path)))
    target = tmp_path / "policy.png"
    plot_compilerkv(tables, target)
    assert target.stat().st_size > 10_000
