"""CompilerKV's stabilized utility, head-weighted max pooling and risk signals."""

from __future__ import annotations

import math

import pytest
import torch

import kvtrim
from conftest import tiny_model
from kvtrim.artifacts.compilerkv import CompiledTables, TableSource
from kvtrim.compression.compressor import BudgetSpec, layer_views
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.methods import get_method
from kvtrim.runtime import Prefill
from kvtrim.scoring.risk import bin_index, local_perplexity, quantile_edges, structural_entropy
from kvtrim.scoring.stabilized_utility import StabilizedUtilityScorer


def _views(model, ids, mask=None, window=16):
    """Prefill ``ids`` and build the compressor's layer views (with cross-layer preparation)."""
    scorer = StabilizedUtilityScorer(TableSource(neutral=True), window=window)
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre = Prefill.plain(model, ids, mask, scorer.observation)
    cache = pre.cache
    context = mask.sum(-1)
    views = layer_views(cache, context, shared={"keep": torch.full_like(context, 10)})
    scorer.prepare(views)
    return scorer, views, cache


def test_alpha_and_rho_have_mean_one_over_real_tokens():
    model = tiny_model("llama", layers=3)
    ids = torch.randint(3, 200, (2, 50), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :12] = 0  # left padding
    scorer, views, _ = _views(model, ids, mask)
    alpha = views[0].shared["alpha"]
    for row, length in enumerate(mask.sum(-1).tolist()):
        assert math.isclose(float(alpha[row, :length].mean()), 1.0, rel_tol=1e-5)
    for view in views:
        rho = scorer._rho(view)
        for row in range(2):
            valid = view.positions[row, 0] >= 0
            for h in range(view.kv_heads):
                assert math.isclose(float(rho[row, h][valid].mean()), 1.0, rel_tol=1e-4)


def test_raw_utility_also_has_mean_one():
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    _, views, _ = _views(model, ids)
    raw = StabilizedUtilityScorer(TableSource(neutral=True), window=16, utility="raw")
    u = raw.per_query_head(views[0])  # [1, q_heads, seq]
    assert torch.allclose(u.mean(-1), torch.ones(1, u.shape[1]), atol=1e-5)


def test_weighted_max_pooling_over_heads_matches_hand_computation():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(2))
    scorer, views, _ = _views(model, ids)
    weights = torch.tensor([[[1.0, 1.5, 0.8, 0.9], [1.2, 0.8, 1.0, 1.4]]])  # [budgets=1, layers=2, heads=4]
    tables = CompiledTables([10], weights, torch.full((1, 2, 2, 2), 0.9), torch.tensor([1.0]), torch.tensor([5.0]))
    scorer.tables = TableSource(tables=tables)
    views[0].shared["budget_index"] = torch.zeros(1, dtype=torch.long)
    for view in views:
        u = scorer.per_query_head(view)[0]  # [4, seq]: query heads 0,1 share KV head 0; 2,3 share KV head 1
        expected = (weights[0, view.layer_idx][:, None] * u).amax(0)
        got = scorer.score(view)
        assert got.shape == (1, 2, 30)
        assert torch.allclose(got[0, 0], expected) and torch.equal(got[0, 0], got[0, 1])
        # the max, never the mean: a reliable head can veto the others
        assert not torch.allclose(expected, (weights[0, view.layer_idx][:, None] * u).mean(0))


def test_risk_signals():
    mass = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    h = structural_entropy(mass, valid)
    assert math.isclose(float(h[0]), math.log(4), rel_tol=1e-6) and abs(float(h[1])) < 1e-6
    lp = torch.tensor([[math.log(0.5), math.log(0.5)], [float("nan"), float("nan")]])
    ppl = local_perplexity(lp, 2)
    assert math.isclose(float(ppl[0]), 2.0, rel_tol=1e-6) and math.isnan(float(ppl[1]))
    assert torch.isnan(local_perplexity(None, 3)).all()


def test_binning_with_stored_edges_is_searchsorted_right():
    edges = quantile_edges(torch.arange(1.0, 101.0), 4)  # equal-frequency edges of 1..100
    assert torch.allclose(edges, torch.tensor([25.75, 50.5, 75.25]))
    values = torch.tensor([0.0, 25.75, 50.0, 50.5, 99.0])
    assert bin_index(values, edges).tolist() == [0, 1, 1, 2, 3]  # a value on an edge goes to the upper bin


def test_prompt_logprobs_match_the_model_logits():
    model = tiny_model("mistral", layers=2)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(3))
    _, _, cache = _views(model, ids, window=16)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.float()
    ref = torch.log_softmax(logits[0, -17:-1], -1).gather(-1, ids[0, -16:, None]).squeeze(-1)
    assert cache.prompt_logprobs.shape == (1, 16)
    assert torch.allclose(cache.prompt_logprobs[0], ref, atol=1e-4)


def test_chunked_prefill_records_the_same_logprobs():
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(4))
    pipeline = get_method("compilerkv_neutral", window=16)

    with torch.inference_mode(), kvtrim_attention_enabled(model):
        one = Prefill.plain(model, ids, torch.ones_like(ids), pipeline.observation).cache.prompt_logprobs
        chunked = Prefill.chunked(model, ids, torch.ones_like(ids), 10, pipeline, BudgetSpec(budget=1000))
    assert torch.allclose(one, chunked.cache.prompt_logprobs, atol=1e-4)


@pytest.mark.parametrize(
    "option",
    [{"alpha": "window_cumulative"}, {"rho": "head_mean"}, {"utility": "raw"}, {"normalize": "max", "keep_window": 8}],
)
def test_v1_options_and_ablations_run_through_the_api(llama, tokenizer, option, monkeypatch, tmp_path):
    from conftest import install_compilerkv_tables

    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    install_compilerkv_tables(llama)
    text = "the quick brown fox jumps over the lazy dog. " * 6
    result = kvtrim.generate(
        llama, tokenizer, text, "what?", method="compilerkv", budget=20, max_new_tokens=3,
        method_params={"window": 16, **option},
    )
    assert result.stats.kv_entries_after == 20 * 2 * len(llama.model.layers)
    assert result.stats.compression_metadata["compilerkv_compiled_budget"] == [20]
    if option.get("alpha") == "window_cumulative":
        scorer = StabilizedUtilityScorer(TableSource(neutral=True), window=16, **option)
        assert "attn_band_sum" in scorer.observation.accumulate


def test_bad_options_raise():
    for bad in ({"utility": "mean"}, {"alpha": "x"}, {"rho": "y"}, {"window": 0}):
        with pytest.raises(ValueError):
            StabilizedUtilityScorer(TableSource(neutral=True), **bad)
