"""KVzap and Fast KVzip calibrations: KVzip targets, the ridge, MLP and gate fits, the fit report, the artifacts and
the CLI."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from conftest import byte_tokenizer, tiny_model
from kvtrim.artifacts.surrogates import load_surrogate
from kvtrim.calibration.cli import calibrate_app
from kvtrim.calibration.fastkvzip import FastKVzipCalibration, fit_gate
from kvtrim.calibration.kvzap import KVzapCalibration, fit_mlp, fit_ridge
from kvtrim.calibration.kvzip_targets import TargetSettings, kvzip_targets, spearman
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method

runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path / "home"))


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_ridge_recovers_a_linear_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2, 5, generator=g)  # [n, layers, hidden]
    w = torch.randn(2, 3, 5, generator=g)  # [layers, kv_heads, hidden]
    b = torch.randn(2, 3, generator=g)
    y = torch.einsum("nlh,lkh->nlk", x, w) + b
    fit = fit_ridge(x, y, penalty=0.0)
    assert torch.allclose(fit["linear_weight"], w, atol=1e-4) and torch.allclose(fit["linear_bias"], b, atol=1e-4)


def test_mlp_training_lowers_the_loss():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 2, 6, generator=g)
    y = torch.tanh(x[..., :2]) * 3  # [n, 2 layers, 2 heads]
    tensors, losses = fit_mlp(x, y, KVzapCalibration(hidden_dim=16, epochs=20, batch_size=64), seed=0)
    assert losses[-1] < 0.5 * losses[0]
    assert tensors["mlp_w1"].shape == (2, 16, 6) and tensors["mlp_w2"].shape == (2, 2, 16)


def test_spearman_by_hand():
    a = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert torch.allclose(spearman(a, a * 10), torch.tensor([1.0], dtype=torch.float64))
    assert torch.allclose(spearman(a, -a), torch.tensor([-1.0], dtype=torch.float64))


def test_targets_are_the_kvzip_method_scores():
    """The targets rank entries exactly as the ``kvzip`` method does: its kept set is their top-k."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match="no tokenizer"):
        targets = kvzip_targets(model, ids)
    assert targets.hidden.shape == (2, 48, model.config.hidden_size) and targets.scores.shape == (2, 2, 48)
    pipeline = get_method("kvzip", layerwise=True)
    with pytest.warns(UserWarning, match="no tokenizer"):
        pipeline.bind(model)
    cache = KVTrimCache(2, pipeline, BudgetSpec(budget=12), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.compress()
    for layer in cache.layers:
        top = targets.scores[layer.layer_idx].topk(12, dim=-1).indices.sort(-1).values
        assert torch.equal(layer.store.positions[0].sort(-1).values, top)


def test_settings_are_checked():
    with pytest.raises(InvalidParameterError, match="prompts"):
        TargetSettings(prompts=0)
    with pytest.raises(InvalidParameterError, match="pydoc"):
        TargetSettings(tasks=(), pydoc=False)
    with pytest.raises(InvalidParameterError, match="keep_fraction"):
        KVzapCalibration(keep_fraction=1.0)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-kvzap")
    tiny_model("llama", layers=2, heads=4, kv_heads=2).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_cli_kvzap_writes_an_artifact_the_method_loads(saved_model, tmp_path):
    out_dir = tmp_path / "arts"
    args = ["kvzap", "--model", str(saved_model), "--prompts", "2", "--heldout", "1", "--length", "300"]
    args += ["--tokens-per-prompt", "64", "--tasks", "passkey", "--no-pydoc", "--epochs", "2", "--hidden-dim", "8"]
    args += ["--out", str(out_dir), "--no-progress", "--threads", "1"]
    result = runner.invoke(calibrate_app, args)
    assert result.exit_code == 0, result.output
    assert "kvzap artifact:" in result.output and "held-out mlp:" in result.output
    assert "training tokens: 128" in result.output
    assert list((tmp_path / "home" / "kvzip_targets").glob("*.pt"))  # the targets wait for the next calibration
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(saved_model)
    tensors, source = load_surrogate(model, "mlp", out_dir)
    assert tensors["mlp_w1"].shape == (2, 8, 64) and source["artifact"].endswith("kvzap.safetensors")
    show = ["show", "--model", str(saved_model), "--kind", "kvzap", "--path", str(out_dir)]
    shown = runner.invoke(calibrate_app, show)
    assert shown.exit_code == 0 and "heldout_spearman_mlp: 2x2" in shown.output
    missing = runner.invoke(calibrate_app, ["show", "--model", str(saved_model), "--kind", "kvzap"])
    assert missing.exit_code == 2 and "kvtrim calibrate kvzap --model" in missing.output


def test_gate_training_lowers_the_loss():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 2, 8, generator=g)
    y = torch.sigmoid(3 * x[..., :2])  # [n, 2 layers, 2 heads], in (0, 1) as KVzip's scores
    tensors, losses = fit_gate(x, y, 2, FastKVzipCalibration(width=4, sinks=2, epochs=15, batch_size=64), seed=0)
    assert losses[-1] < 0.8 * losses[0]
    assert tensors["gate_q_weight"].shape == (2, 2 * 2 * 4, 8) and tensors["gate_sink_keys"].shape == (2, 2, 2, 4)


def test_cli_fastkvzip_reuses_the_kvzap_targets(saved_model, tmp_path):
    common = ["--model", str(saved_model), "--prompts", "2", "--heldout", "1", "--length", "300"]
    common += ["--tokens-per-prompt", "64", "--tasks", "passkey", "--no-pydoc", "--epochs", "1"]
    common += ["--out", str(tmp_path / "arts"), "--no-progress", "--threads", "1"]
    assert runner.invoke(calibrate_app, ["kvzap", *common, "--hidden-dim", "4"]).exit_code == 0
    result = runner.invoke(calibrate_app, ["fastkvzip", *common, "--width", "4", "--sinks", "2"])
    assert result.exit_code == 0, result.output
    assert "fastkvzip artifact:" in result.output and "targets cached: True" in result.output
    assert "held-out gate:" in result.output


def test_the_commands_default_tasks_are_the_calibration_prompts_default():
    """The CLI spells the default task list out (so that `kvtrim --help` imports no torch): it must stay equal."""
    from kvtrim.calibration.cli import SURROGATE_TASKS
    from kvtrim.calibration.kvzip_targets import SYNTHETIC_TASKS

    assert tuple(SURROGATE_TASKS.split(",")) == SYNTHETIC_TASKS == TargetSettings().tasks
