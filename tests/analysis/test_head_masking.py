"""Head masking analysis: the o_proj pre-hook zeroes heads and is always removed."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import install_compresskv_scores, tiny_model
from kvtrim.analysis.head_masking import head_masking_analysis, mask_heads, top_heads, write_report
from kvtrim.errors import InvalidParameterError


def _hooks(model) -> int:
    return sum(len(layer.self_attn.o_proj._forward_pre_hooks) for layer in model.model.layers)


def test_mask_heads_zeroes_the_head_slice_and_removes_the_hook():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    seen = {}
    probe = model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, a, o: seen.update(x=a[0].clone()))
    with torch.no_grad():
        ref = model(ids).logits
        with mask_heads(model, [(1, 2), (0, 0)]) as handles:
            assert len(handles) == 2 and _hooks(model) == 2
            masked = model(ids).logits
    probe.remove()
    assert bool((seen["x"][..., 32:48] == 0).all()) and bool((seen["x"][..., :32] != 0).any())
    assert not torch.allclose(ref, masked)
    assert _hooks(model) == 0
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref)
    with pytest.raises(RuntimeError), mask_heads(model, [(0, 1)]):
        raise RuntimeError("boom")
    assert _hooks(model) == 0
    with pytest.raises(InvalidParameterError), mask_heads(model, [(5, 0)]):
        pass


def test_top_heads_over_the_whole_model():
    scores = torch.tensor([[0.1, 0.9], [0.8, 0.2]])
    assert top_heads(scores, 3) == [(0, 1), (1, 0), (1, 1)]


def test_analysis_runs_and_removes_hooks(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path / "home"))
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    install_compresskv_scores(model)
    report = head_masking_analysis(model, tokenizer, [2], ["passkey"], length=300, samples=1, progress=False)
    assert set(report.accuracy) == {"none", "srh@2", "trh@2", "random@2"}
    assert len(report.masked["srh@2"]) == 2 and _hooks(model) == 0
    files = write_report(report, tmp_path / "out")
    data = json.loads(files[0].read_text())
    assert data["ks"] == [2] and "passkey" in data["accuracy"]["none"]
    assert files[-1].suffix == ".png" and files[-1].stat().st_size > 1000
