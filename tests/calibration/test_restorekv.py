"""`kvtrim calibrate restorekv`: restore embeddings and an attention LoRA trained by self-distillation."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from kvtrim.artifacts.restorekv import load_restore_weights
from kvtrim.artifacts.store import load_artifact
from kvtrim.calibration.restorekv import RestoreKVCalibration, calibrate_restorekv, distillation_kl
from kvtrim.errors import InvalidParameterError


def test_distillation_kl_is_zero_for_the_teacher_and_positive_otherwise():
    logits = torch.randn(5, 11)
    teacher = torch.log_softmax(logits, dim=-1)
    assert float(distillation_kl(teacher, logits)) == pytest.approx(0.0, abs=1e-6)
    assert float(distillation_kl(teacher, logits.flip(-1))) > 0


@pytest.mark.filterwarnings("ignore:kvzip. no tokenizer")
def test_calibration_trains_and_saves_an_artifact_the_method_loads(tokenizer, tmp_path):
    model = tiny_model("llama")
    settings = RestoreKVCalibration(
        prompts=2, heldout=1, length=288, continuation=8, tokens=2, rank=2, steps=3, tasks=("passkey",), pydoc=False,
        ratios=(0.5,),
    )
    path = calibrate_restorekv(model, tokenizer, settings, out_dir=tmp_path)
    artifact = load_artifact("restorekv", model, path)
    assert artifact.meta["settings"]["tokens"] == 2
    fit = artifact.meta["summary"]["heldout_kl"]["0.5"]
    assert fit["restorekv_kl"] >= 0 and fit["kvzip_kl"] >= 0
    weights, _ = load_restore_weights(model, path)
    assert weights.tokens == 2 and set(weights.lora) == {"q", "k", "v", "o"}
    assert all(bool(b.abs().sum() > 0) for _, b in weights.lora.values())  # B left zero: trained
    assert not any(p.requires_grad is False for p in model.parameters())  # the model's flags are restored


def test_bad_settings_are_named():
    with pytest.raises(InvalidParameterError, match="targets"):
        RestoreKVCalibration(targets=("gate",))
    with pytest.raises(InvalidParameterError, match="ratios"):
        RestoreKVCalibration(ratios=(1.0,))
    with pytest.raises(InvalidParameterError, match="tokens"):
        RestoreKVCalibration(tokens=0)
