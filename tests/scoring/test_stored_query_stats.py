"""Expected Attention with stored query statistics: the statistics are what the prompt's own would have been."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from conftest import byte_tokenizer, tiny_model
from kvtrim.artifacts.query_stats import load_query_statistics
from kvtrim.budgets.uniform import UniformBudget
from kvtrim.calibration.cli import calibrate_app
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.errors import MissingArtifactError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method
from kvtrim.methods.registry import parts
from kvtrim.scoring.expected_attention import StoredStatsExpectedAttentionScorer, query_statistics, unrotate
from kvtrim.scoring.rope import rope_frequencies
from kvtrim.selection.topk import TopKSelector

runner = CliRunner()


def _kept(model, ids, pipeline, budget=12):
    cache = KVTrimCache(model.config.num_hidden_layers, pipeline, BudgetSpec(budget=budget), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.compress()
    return [layer.store.positions[0].sort(-1).values for layer in cache.layers], cache


def test_the_prompts_own_statistics_reproduce_expected_attention():
    """Given the statistics of the prompt's own queries, the stored-statistics scorer keeps what
    ``expected_attention`` keeps: the statistics are the only difference."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(5))
    reference, _ = _kept(model, ids, get_method("expected_attention"))
    means, covs = [], []
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        fresh = KVTrimCache(2, get_method("expected_attention"), BudgetSpec(budget=12), auto_compress=False)
        model(input_ids=ids, past_key_values=fresh, use_cache=True)
    for layer in fresh.layers:
        obs = layer.observation
        inv_freq, scale = rope_frequencies(layer.module.config, layer.store.keys.shape[-1], ids.device)
        q = unrotate(obs.queries, obs.positions, inv_freq, scale)
        mean, cov = query_statistics(q, obs.positions, 4, True)
        means.append(mean[0])
        covs.append(cov[0])
    scorer = StoredStatsExpectedAttentionScorer(mean=torch.stack(means), cov=torch.stack(covs))
    assert scorer.observation.window == 0  # nothing recorded at prefill
    got, _ = _kept(model, ids, parts(scorer, UniformBudget(), TopKSelector(sink=4)))
    for a, b in zip(got, reference, strict=True):
        assert torch.equal(a, b)


def test_missing_statistics_name_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama", layers=2, seed=9)
    with pytest.raises(MissingArtifactError, match="kvtrim calibrate expected_attention_stats"):
        get_method("expected_attention_stats").bind(model)


def test_cli_writes_statistics_the_method_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path / "home"))
    path = tmp_path / "model"
    model = tiny_model("llama", layers=2)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    args = ["expected_attention_stats", "--model", str(path), "--prompts", "2", "--length", "300", "--tasks"]
    args += ["passkey", "--no-pydoc", "--no-progress", "--threads", "1"]
    result = runner.invoke(calibrate_app, args)
    assert result.exit_code == 0, result.output
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    mean, cov = load_query_statistics(loaded)
    assert mean.shape == (2, 4, 16) and cov.shape == (2, 4, 16, 16)
    assert torch.allclose(cov, cov.transpose(-1, -2), atol=1e-4)
    assert bool((torch.diagonal(cov, dim1=-2, dim2=-1) >= -1e-5).all())
    pipeline = get_method("expected_attention_stats").bind(loaded)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    kept, _ = _kept(loaded, ids, pipeline)
    assert all(bool((k[:, :4] == torch.arange(4)).all()) for k in kept)  # sinks kept
