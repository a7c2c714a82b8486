"""CompressKV methods in the registry: artifacts, budgets, shared selection, variants."""

from __future__ import annotations

import re

import pytest
import torch

import kvtrim
import kvtrim.calibration
from conftest import install_compresskv_scores, install_head_scores, random_text, tiny_model
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.errors import MissingArtifactError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method, method_info

COMPRESSKV_METHODS = ["compresskv", "compresskv_srh_only", "compresskv_trh", "head_compresskv", "ada_compresskv"]


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path / "home"))


def _compress(model, pipeline, budget, n=160, seed=0):
    cache = KVTrimCache(model.config.num_hidden_layers, pipeline.bind(model), BudgetSpec(budget=budget), False)
    ids = torch.randint(3, 200, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        report = cache.compress()
    return cache, report


@pytest.mark.parametrize("method", COMPRESSKV_METHODS)
def test_registry_entries_cite_the_paper(method):
    info = method_info(method)
    assert "2508.02401" in info.paper and "2508.02401" in (info.factory.__doc__ or "")
    assert info.defaults()["heads_per_layer"] == 4


@pytest.mark.parametrize("method", COMPRESSKV_METHODS)
def test_missing_artifact_names_the_command_at_bind_time(method, tokenizer):
    model = tiny_model("llama")
    with pytest.raises(MissingArtifactError, match=re.escape("kvtrim calibrate compresskv --model")):
        kvtrim.generate(model, tokenizer, random_text(200), "q?", method=method, budget=64, max_new_tokens=2)


def test_error_aware_budgets_reallocate_and_keep_the_total(tokenizer):
    model = tiny_model("llama", layers=4, heads=4, kv_heads=2)
    path = install_compresskv_scores(model)
    layer_scores = kvtrim.calibration.load_artifact("compresskv", model, path).tensors["layer_scores"]
    cache, _ = _compress(model, get_method("compresskv", artifact=str(path)), budget=48)
    per_head = cache.entries_per_layer_head()[0]  # [layers, kv_heads]
    assert bool((per_head == per_head[:, :1]).all())  # same budget for every KV head of a layer
    assert int(per_head[:, 0].sum()) == 4 * 48  # mean B per layer
    assert int(per_head.min()) >= 32 and int(per_head.max()) <= 144
    order = torch.argsort(layer_scores, descending=True)
    assert int(per_head[order[0], 0]) >= int(per_head[order[-1], 0])  # the most error-prone layer keeps most
    assert len(set(per_head[:, 0].tolist())) > 1
    for layer in cache.layers:  # one token set per layer, window included
        pos = layer.store.positions[0]
        assert bool((pos == pos[:1]).all())
        assert set(range(160 - 8, 160)) <= set(pos[0].tolist())


def test_srh_and_trh_rankings_select_differently():
    model = tiny_model("llama", layers=2, heads=8, kv_heads=2)
    path = str(install_compresskv_scores(model))
    srh = get_method("compresskv_srh_only", artifact=path).bind(model)
    trh = get_method("compresskv_trh", artifact=path).bind(model)
    assert srh.scorer.heads.shape == (2, 4) and not torch.equal(srh.scorer.heads, trh.scorer.heads)
    two = get_method("compresskv_srh_only", artifact=path, heads_per_layer=2).bind(model)
    assert torch.equal(two.scorer.heads, srh.scorer.heads[:, :2])
    with pytest.raises(kvtrim.InvalidParameterError, match="heads_per_layer"):
        get_method("compresskv", artifact=path, heads_per_layer=9).bind(model)


def test_srh_only_keeps_uniform_budgets():
    model = tiny_model("qwen2", layers=3)
    path = str(install_compresskv_scores(model))
    cache, _ = _compress(model, get_method("compresskv_srh_only", artifact=path), budget=40)
    assert bool((cache.entries_per_layer_head() == 40).all())


def test_variants_keep_their_totals(monkeypatch, tmp_path):
    model = tiny_model("llama", layers=3, heads=4, kv_heads=2)
    install_head_scores(model, monkeypatch, tmp_path)  # headkv + compresskv artifacts in the kvtrim home
    cache, _ = _compress(model, get_method("head_compresskv"), budget=48)
    per_head = cache.entries_per_layer_head()[0]
    assert int(per_head.sum()) == 3 * 2 * 48
    cache, _ = _compress(model, get_method("ada_compresskv"), budget=48)
    per_head = cache.entries_per_layer_head()[0]
    layer_budgets = get_method("compresskv").bind(model).budget._inner.layer_budgets(48, 160)
    assert per_head.sum(-1).tolist() == (layer_budgets * 2).tolist()  # AdaKV splits each layer's total


def test_budget_at_or_above_context_generates_identically(tokenizer):
    model = tiny_model("mistral", layers=2)
    path = str(install_compresskv_scores(model))
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(5))
    ref = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with kvtrim.compressing(model, "compresskv", budget=40, artifact=path) as cache:
        out = model.generate(
            input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, past_key_values=cache
        )
    assert torch.equal(out, ref) and cache.last_report.skipped
