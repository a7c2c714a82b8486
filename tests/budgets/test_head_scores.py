"""HeadKV per-head budgets from head scores."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.head_scores import HeadScoreBudget, exact_bounded_round, head_score_capacities
from kvtrim.errors import InvalidParameterError


def _request(keep, context, layers=4, kv_heads=2):
    return BudgetRequest(
        keep=torch.tensor(keep), context_lengths=torch.tensor(context), num_layers=layers, kv_heads=kv_heads
    )


def _scores(layers=4, heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(layers, heads, generator=g) ** 3


def test_capacities_follow_headkv_formula():
    s = torch.tensor([[1.0, 3.0], [0.0, 4.0]])
    caps = head_score_capacities(s, selected=100, beta=1.5)
    share = 100 // 1.5  # 66.0
    expected = s / s.sum() * share * 4 + (100 - share)
    torch.testing.assert_close(caps, expected.double())
    assert abs(float(caps.mean()) - 100) < 1e-9
    hot = head_score_capacities(s, 100, beta=1.5, temperature=2.0)
    assert hot[1, 1] > caps[1, 1] and hot[0, 0] < caps[0, 0]  # temperature > 1 sharpens
    torch.testing.assert_close(head_score_capacities(torch.zeros(2, 2), 50, 1.01), torch.full((2, 2), 50.0).double())


def test_budgets_sum_exactly_and_include_window():
    budget = HeadScoreBudget(_scores(), beta=1.2, window=8)
    out = budget.allocate(_request([101, 300, 37], [1000, 1000, 500]), [])
    assert out.shape == (3, 4, 2) and out.dtype == torch.long
    for row, keep in enumerate([101, 300, 37]):
        assert int(out[row].sum()) == keep * 4 * 2
        assert bool((out[row] >= 8).all())
    assert len(set(out[0].flatten().tolist())) > 1  # not uniform


def test_clamps_respected_and_total_kept():
    scores = torch.zeros(4, 4)
    scores[0, 0] = 1.0  # one head takes the whole pool
    out = HeadScoreBudget(scores, beta=1.005, window=8, min_keep=12).allocate(_request([200], [260]), [])[0]
    assert int(out.max()) <= 260 and int(out.min()) >= 12
    assert int(out.sum()) == 200 * 8  # what the capped head could not take went to the others
    assert int(out[0, 0]) == 260


def test_infeasible_totals_clamp_to_bounds():
    x = torch.tensor([5.0, 5.0])
    assert exact_bounded_round(x, 100, 1, 20).tolist() == [20, 20]
    assert exact_bounded_round(x, 0, 3, 20).tolist() == [3, 3]


def test_beta_direction_smaller_beta_more_spread():
    budget_args = {"window": 8}
    spreads = []
    for beta in [1.005, 1.2, 2.0, 10.0]:
        out = HeadScoreBudget(_scores(), beta=beta, **budget_args).allocate(_request([200], [2000]), [])[0]
        spreads.append(float(out.double().std()))
    assert spreads == sorted(spreads, reverse=True) and spreads[0] > 3 * spreads[-1]


def test_gqa_aggregation_is_group_mean():
    scores = torch.tensor([[4.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])  # 2 layers, 4 query heads, 2 KV heads
    budget = HeadScoreBudget(scores, beta=1.5, window=0, min_keep=1)
    caps = head_score_capacities(scores, 90, 1.5)
    torch.testing.assert_close(budget.kv_capacities(90, 2), caps.view(2, 2, 2).mean(-1))
    out = budget.allocate(_request([90], [1000], layers=2, kv_heads=2), [])[0]
    expected = caps.view(2, 2, 2).mean(-1)
    assert (out.double() - expected).abs().max() < 1.0 and int(out.sum()) == 90 * 4
    # scores already at KV-head granularity are used as is
    assert HeadScoreBudget(scores[:, :2], beta=1.5).kv_capacities(90, 2).shape == (2, 2)


def test_small_keep_and_full_context_are_uniform():
    budget = HeadScoreBudget(_scores(), beta=1.01, window=8)
    out = budget.allocate(_request([6, 500], [1000, 500]), [])
    assert bool((out[0] == 6).all()) and bool((out[1] == 500).all())


def test_validation():
    with pytest.raises(InvalidParameterError, match="beta"):
        HeadScoreBudget(_scores(), beta=1.0)
    with pytest.raises(InvalidParameterError, match="non-negative"):
        HeadScoreBudget(-_scores())
    with pytest.raises(InvalidParameterError, match="layers"):
        HeadScoreBudget(_scores(layers=3)).allocate(_request([100], [1000]), [])
    with pytest.raises(InvalidParameterError, match="multiple"):
        HeadScoreBudget(_scores(heads=3)).allocate(_request([100], [1000]), [])


@settings(max_examples=60, deadline=None)
@given(
    keep=st.integers(1, 400),
    extra=st.integers(0, 600),
    beta=st.sampled_from([1.005, 1.01, 1.1, 1.2, 1.5, 2.0, 5.0, 10.0]),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    seed=st.integers(0, 5),
)
def test_exact_total_property(keep, extra, beta, temperature, seed):
    context = keep + extra
    budget = HeadScoreBudget(_scores(seed=seed), beta=beta, temperature=temperature, window=8)
    out = budget.allocate(_request([keep], [context]), [])[0]
    assert int(out.sum()) == keep * 8
    assert int(out.max()) <= context and int(out.min()) >= min(keep, 8)


def test_from_artifact_and_missing(tmp_path, monkeypatch):
    from conftest import tiny_model
    from kvtrim.artifacts.store import save_artifact
    from kvtrim.errors import MissingArtifactError

    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    with pytest.raises(MissingArtifactError, match="kvtrim calibrate headkv"):
        HeadScoreBudget.from_artifact(model)
    save_artifact("headkv", model, {"retrieval_reasoning": _scores(2, 4), "retrieval": _scores(2, 4, 1)}, {})
    budget = HeadScoreBudget.from_artifact(model, beta=2.0)
    assert budget.beta == 2.0 and budget.source["scores"] == "retrieval_reasoning"
    torch.testing.assert_close(budget.head_scores, _scores(2, 4).double())
    assert HeadScoreBudget.from_artifact(model, scores="retrieval").source["scores"] == "retrieval"
