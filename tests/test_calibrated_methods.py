"""Q-Filters and LU-KV: offline-calibrated kvpress presses as kvtrim methods."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import kvtrim
from conftest import byte_tokenizer, install_lukv_curves, install_qfilters, random_text, tiny_model
from kvtrim.artifacts.lukv import load_lukv_curves
from kvtrim.artifacts.qfilter import load_qfilters
from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.uniform import UniformBudget
from kvtrim.budgets.utility_curves import UtilityCurveBudget, keep_fractions_at
from kvtrim.calibration.cli import calibrate_app
from kvtrim.calibration.lukv import LUKVCalibration, calibrate_lukv, concave_gains, greedy_head_budgets
from kvtrim.calibration.qfilter import QFilterCalibration, calibrate_qfilter, filters_from_gram
from kvtrim.compression.pipeline import Pipeline
from kvtrim.errors import InvalidParameterError, MissingArtifactError
from kvtrim.scoring.base import LayerView
from kvtrim.scoring.observation import LayerObservation
from kvtrim.scoring.query_filter import QueryFilterScorer
from kvtrim.selection.topk import TopKSelector

CTX = random_text(300, seed=4)
QUESTIONS = ["What comes next?", "Repeat the start."]
runner = CliRunner()


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path / "home"))


def _view(keys: torch.Tensor, layer: int = 0) -> LayerView:
    b, h, n, _ = keys.shape
    positions = torch.arange(n).expand(b, h, n).clone()
    return LayerView(
        layer_idx=layer,
        num_layers=1,
        keys=keys,
        values=torch.zeros_like(keys),
        positions=positions,
        context_lengths=torch.full((b,), n),
        observation=LayerObservation(),
        stats={},
        module=None,
        scaling=keys.shape[-1] ** -0.5,
    )


# ------------------------------------------------------------------------------------------------ Q-Filters
def test_qfilter_scores_are_projections_and_keep_the_largest():
    u = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0]]])  # [1 layer, 2 kv heads, 4]
    keys = torch.zeros(1, 2, 5, 4)
    keys[0, 0, :, 0] = torch.tensor([0.5, -2.0, 3.0, 1.0, 0.0])
    keys[0, 1, :, 3] = torch.tensor([0.5, -2.0, 3.0, 1.0, 0.0])
    keys[0, :, :, 1] = 10.0  # orthogonal to both filters: no effect on the score
    scorer = QueryFilterScorer(filters=u)
    scores = scorer.score(_view(keys))
    assert scores[0, 0].tolist() == [0.5, -2.0, 3.0, 1.0, 0.0]
    assert scores[0, 1].tolist() == [-0.5, 2.0, -3.0, -1.0, 0.0]
    sel = TopKSelector().select(_view(keys), scores, torch.tensor([[2, 2]]))
    kept = [sorted(sel.indices[0, h][sel.keep_mask[0, h]].tolist()) for h in range(2)]
    assert kept == [[2, 3], [1, 4]]
    with pytest.raises(InvalidParameterError, match="KV heads"):
        scorer.score(_view(torch.zeros(1, 3, 5, 4)))
    with pytest.raises(InvalidParameterError, match="filters"):
        QueryFilterScorer(filters=torch.zeros(2, 4))


def test_qfilter_direction_is_the_queries_principal_one_oriented_positively():
    g = torch.Generator().manual_seed(0)
    u = torch.tensor([0.6, 0.0, 0.8, 0.0])
    for sign in (1.0, -1.0):
        q = sign * 5.0 * u + 0.3 * torch.randn(400, 4, generator=g)  # anisotropic queries along ±u
        f, explained = filters_from_gram((q.T @ q)[None], q.sum(0)[None])
        assert torch.allclose(f[0], sign * u, atol=0.05)
        assert (q @ f[0] > 0).float().mean() > 0.99 and float(explained[0]) > 0.9
        # the defining property: ranking keys by ⟨k, u⟩ ranks them by their mean attention logit over the queries
        keys = torch.randn(50, 4, generator=g)
        mean_logit = (q @ keys.T).mean(0)
        top_filter = set(torch.topk(keys @ f[0], 10).indices.tolist())
        top_logit = set(torch.topk(mean_logit, 10).indices.tolist())
        assert len(top_filter & top_logit) >= 9


def test_qfilter_without_artifact_names_the_command():
    with pytest.raises(MissingArtifactError, match="kvtrim calibrate qfilter"):
        kvtrim.generate(tiny_model(), byte_tokenizer(), CTX, "q?", method="qfilter", ratio=0.5, max_new_tokens=2)
    with pytest.raises(MissingArtifactError, match="kvtrim calibrate lukv"):
        kvtrim.generate(tiny_model(), byte_tokenizer(), CTX, "q?", method="lukv", ratio=0.5, max_new_tokens=2)


# ------------------------------------------------------------------------------------------------ LU-KV solver
def test_concave_gains_pool_adjacent_violators():
    assert concave_gains(torch.tensor([1.0, 3.0, 0.0, 2.0])).tolist() == [2.0, 2.0, 1.0, 1.0]
    assert concave_gains(torch.tensor([3.0, 2.0, 1.0])).tolist() == [3.0, 2.0, 1.0]
    gains = torch.rand(50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    slopes = concave_gains(gains)
    assert bool((slopes.diff() <= 1e-12).all())  # concave
    assert bool((slopes.cumsum(0) >= gains.double().cumsum(0) - 1e-9).all())  # a majorant
    assert abs(float(slopes.sum() - gains.sum())) < 1e-9  # with the same end point


def test_greedy_budgets_follow_marginal_future_utility():
    # head 0: its scorer ranks the useful entries first; head 1: utility spread evenly; head 2: all in one entry
    # that its scorer ranks last (the hull spreads that over the whole head: a low marginal utility per entry)
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    utility = torch.tensor([[0.5, 0.4, 0.05, 0.05], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 0.0, 0.6]])
    counts = greedy_head_budgets(scores, utility, [0, 2, 4, 6, 12])
    assert counts.sum(1).tolist() == [0, 2, 4, 6, 12]
    assert counts[1].tolist() == [2, 0, 0]
    assert counts[2].tolist() == [2, 2, 0]
    assert counts[3].tolist() == [2, 4, 0] or counts[3].tolist() == [2, 0, 4]
    # protected sinks and recent entries come first whatever their utility
    counts = greedy_head_budgets(scores, utility, [6], sink=1, window=1)
    assert bool((counts[0] >= 2).all())


def test_lukv_budget_reads_the_curves_and_keeps_the_total():
    ratios = torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
    keep = torch.tensor([[[1.0, 0.5]], [[0.8, 0.2]], [[0.4, 0.1]]], dtype=torch.float64)  # [3, 1 layer, 2 heads]
    assert keep_fractions_at(ratios, keep, 0.5).tolist() == [[0.8, 0.2]]
    assert torch.allclose(keep_fractions_at(ratios, keep, 0.625), torch.tensor([[0.6, 0.15]], dtype=torch.float64))
    assert keep_fractions_at(ratios, keep, 0.9).tolist() == [[0.4, 0.1]]
    assert keep_fractions_at(ratios, keep, 0.0).tolist() == [[1.0, 1.0]]
    budget = UtilityCurveBudget(protected=2, ratios=ratios, keep_fractions=keep)

    def request(context, kept):
        return BudgetRequest(
            keep=torch.tensor([kept]), context_lengths=torch.tensor([context]), num_layers=1, kv_heads=2
        )

    assert budget.allocate(request(100, 50), []).tolist() == [[[80, 20]]]
    assert budget.allocate(request(100, 100), []).tolist() == [[[100, 100]]]
    for kept in range(1, 100):
        b = budget.allocate(request(100, kept), [])
        assert int(b.sum()) == 2 * kept and int(b.max()) <= 100 and int(b.min()) >= min(2, kept)
    with pytest.raises(InvalidParameterError, match="layers"):
        budget.allocate(BudgetRequest(keep=torch.tensor([5]), context_lengths=torch.tensor([10]), num_layers=2,
                                      kv_heads=2), [])
    with pytest.raises(InvalidParameterError, match="ratios"):
        UtilityCurveBudget(ratios=torch.tensor([0.5, 0.25]), keep_fractions=keep[:2])
    with pytest.raises(InvalidParameterError, match="sink"):
        kvtrim.get_method("lukv", sink=-1)


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture
def installed(llama):
    install_qfilters(llama)
    install_lukv_curves(llama)
    return llama


@pytest.mark.parametrize("method", ["qfilter", "lukv"])
@pytest.mark.parametrize("question_aware", [False, True])
def test_budget_at_context_is_the_full_model(installed, tokenizer, method, question_aware):
    kw = dict(question_aware=question_aware, max_new_tokens=6)
    full = kvtrim.generate(installed, tokenizer, CTX, QUESTIONS, method="full", **kw)
    res = kvtrim.generate(installed, tokenizer, CTX, QUESTIONS, method=method, budget=10_000, **kw)
    assert res.answers == full.answers
    assert res.stats.kv_entries_after == res.stats.kv_entries_before


@pytest.mark.parametrize("method", ["qfilter", "lukv"])
def test_generation_with_calibrated_artifacts(installed, tokenizer, method):
    res = kvtrim.generate(installed, tokenizer, CTX, QUESTIONS, method=method, ratio=0.5, max_new_tokens=6)
    assert all(isinstance(a, str) for a in res.answers)
    st = res.stats
    assert st.kv_entries_after == pytest.approx(st.kv_entries_before / 2, abs=2 * 2 * 2)
    ids = torch.randint(5, 250, (1, 200))
    with torch.no_grad():
        cache = kvtrim.make_cache(installed, method, ratio=0.5)
        installed.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    counts = cache.entries_per_layer_head()
    if method == "lukv":  # per-head counts from the curves, the same total as a uniform budget
        assert int(counts.sum()) == 2 * 2 * 100 + 2 * 2 * 2 and len(set(counts.flatten().tolist())) > 1
    else:
        assert set(counts.flatten().tolist()) == {102}


def test_qfilter_pipeline_keeps_the_largest_projections(installed):
    filters, _ = load_qfilters(installed)
    pipe = Pipeline("qf", QueryFilterScorer(filters=filters), UniformBudget(), TopKSelector())
    cache = kvtrim.KVTrimCache(2, pipe.bind(installed), kvtrim.BudgetSpec(budget=30), auto_compress=False)
    ids = torch.randint(5, 250, (1, 120))
    with kvtrim.integration.attention.kvtrim_attention_enabled(installed), torch.no_grad():
        installed(ids, past_key_values=cache, use_cache=True)
    keys = [layer.store.keys.clone() for layer in cache.layers]
    cache.compress()
    for layer, k in zip(cache.layers, keys, strict=True):
        proj = torch.einsum("bhsd,hd->bhs", k.float(), filters[layer.layer_idx])
        expect = torch.topk(proj, 30, dim=-1).indices.sort(-1).values
        assert torch.equal(layer.store.positions.sort(-1).values, expect)


# ------------------------------------------------------------------------------------------------ calibration
def test_calibrations_on_the_tiny_model(tmp_path):
    model, tok = tiny_model("llama"), byte_tokenizer()
    path = calibrate_qfilter(model, tok, QFilterCalibration(tasks=("passkey",), samples=1, length=300), tmp_path)
    filters, _ = load_qfilters(model, path)
    assert filters.shape == (2, 2, 16) and torch.allclose(filters.norm(dim=-1), torch.ones(2, 2), atol=1e-5)
    path = calibrate_lukv(model, tok, LUKVCalibration(tasks=("passkey",), samples=1, length=300), tmp_path)
    ratios, keep, _ = load_lukv_curves(model, path)
    assert ratios.shape == (99,) and keep.shape == (99, 2, 2)
    assert torch.allclose(keep.mean((1, 2)), 1 - ratios, atol=0.02)  # each ratio's budget is spent
    assert bool((keep.diff(dim=0) <= 1e-6).all())  # a head never gains entries as the ratio grows
    res = kvtrim.generate(model, tok, CTX, "q?", method="lukv", ratio=0.5, max_new_tokens=2,
                          method_params={"artifact": str(path)})
    assert isinstance(res.answers[0], str)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-calibrated")
    tiny_model("llama").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize(("kind", "shape"), [("qfilter", "filters: (2, 2, 16)"), ("lukv", "curves: (99, 2, 2)")])
def test_cli_calibrate(saved_model, tmp_path, kind, shape):
    out_dir = tmp_path / "arts"
    args = [kind, "--model", str(saved_model), "--tasks", "passkey", "--samples", "1", "--length", "300"]
    result = runner.invoke(calibrate_app, [*args, "--out", str(out_dir), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert f"{kind} artifact:" in result.output and shape in result.output
    shown = runner.invoke(calibrate_app, ["show", "--model", str(saved_model), "--kind", kind, "--path", str(out_dir)])
    assert shown.exit_code == 0, shown.output
    missing = runner.invoke(calibrate_app, ["show", "--model", str(saved_model), "--kind", kind])
    assert missing.exit_code == 2 and f"kvtrim calibrate {kind} --model" in missing.output
    bad = runner.invoke(calibrate_app, [kind, "--model", str(saved_model), "--samples", "0"])
    assert bad.exit_code == 2 and "samples" in bad.output
