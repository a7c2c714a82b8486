"""Error-aware layer budgets (CompressKV Algorithm 1)."""

from __future__ import annotations

import pytest
import torch

from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.error_aware import ErrorAwareLayerBudget, LayerThenHeadBudget, error_aware_layer_budgets
from kvtrim.budgets.head_adaptive import HeadAdaptiveBudget
from kvtrim.budgets.uniform import UniformBudget
from kvtrim.errors import InvalidParameterError


def test_sums_to_total_and_respects_bounds():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        layers = 5 + trial % 7
        e = torch.rand(layers, generator=g) ** 3
        mean = 40 + 7 * trial
        b = error_aware_layer_budgets(e, layers * mean, 32, 3 * mean)
        assert int(b.sum()) == layers * mean
        assert int(b.min()) >= 32 and int(b.max()) <= 3 * mean


def test_formula_without_correction():
    e = torch.tensor([0.5, 0.25, 0.25])
    # L*B - L*m = 3*64 - 3*32 = 96 -> 32 + [48, 24, 24]
    assert error_aware_layer_budgets(e, 192, 32, 192).tolist() == [80, 56, 56]


def test_clipping_surplus_goes_to_highest_error_layers_first():
    e = torch.tensor([0.9, 0.05, 0.03, 0.02])
    # raw 32 + round(e * 128) = [147, 38, 36, 35]; clipped at M = 96 -> 205, Δ = 256 - 205 = 51, spread one at a
    # time over the layers below M in descending e: 17 rounds over layers 1, 2, 3
    assert error_aware_layer_budgets(e, 4 * 64, 32, 96).tolist() == [96, 55, 53, 52]


def test_descending_order_for_positive_delta():
    e = torch.tensor([0.1, 0.4, 0.2, 0.3])
    # m = 0, no clipping: round(e * 42) = [4, 17, 8, 13] already sums to 42
    assert error_aware_layer_budgets(e, 42, 0, 100).tolist() == [4, 17, 8, 13]
    # Δ > 0 after clipping: layers 1 and 3 (highest e) are at M; the surplus goes to layer 2, then 0
    b = error_aware_layer_budgets(e, 40, 0, 10)
    assert b.tolist() == [10, 10, 10, 10]
    b = error_aware_layer_budgets(e, 36, 0, 10)  # raw [4, 14->10, 7, 11->10] = 31, Δ=5: layer 2 +3 (to 10), 0 +2
    assert b.tolist() == [6, 10, 10, 10]


def test_ascending_order_for_negative_delta():
    e = torch.tensor([0.1, 0.4, 0.2, 0.3])
    # m = 10, total 44: 10 + round(e * 4) = [10, 12, 11, 11], no correction
    assert error_aware_layer_budgets(e, 44, 10, 100).tolist() == [10, 12, 11, 11]
    # rounding up overshoots: 10 + round(e * 2) = [11, 11, 11] = 33 for a total of 32, Δ = -1
    e3 = torch.tensor([0.3, 0.4, 0.3])
    b = error_aware_layer_budgets(e3, 32, 10, 100)  # raw 10 + round([0.6, 0.8, 0.6]) = [11, 11, 11], Δ=-1
    assert b.tolist() == [10, 11, 11]  # the lowest error (first in ascending order, stable) loses one


def test_totals_that_cannot_be_met():
    e = torch.tensor([0.7, 0.2, 0.1])
    low = error_aware_layer_budgets(e, 20, 10, 50)  # 3 * m = 30 > 20: every layer stays at m
    assert low.tolist() == [10, 10, 10]
    high = error_aware_layer_budgets(e, 200, 10, 50)  # 3 * M = 150 < 200: every layer at M
    assert high.tolist() == [50, 50, 50]
    with pytest.raises(InvalidParameterError):
        error_aware_layer_budgets(e, 30, 20, 10)
    with pytest.raises(InvalidParameterError):
        error_aware_layer_budgets(torch.tensor([-1.0, 2.0]), 30, 1, 100)


def _request(keep, context, layers, kv_heads=2):
    return BudgetRequest(
        keep=torch.tensor(keep),
        context_lengths=torch.tensor(context),
        num_layers=layers,
        kv_heads=kv_heads,
    )


def test_allocator_same_budget_for_every_kv_head_and_mean_b():
    e = torch.tensor([0.05, 0.15, 0.3, 0.5])
    alloc = ErrorAwareLayerBudget(e)
    out = alloc.allocate(_request([64, 20, 500], [1000, 1000, 300], 4), [])
    assert out.shape == (3, 4, 2)
    assert bool((out == out[..., :1]).all())
    assert out[0, :, 0].sum() == 4 * 64 and out[0, :, 0].tolist() == sorted(out[0, :, 0].tolist())
    assert bool((out[0] >= 32).all()) and bool((out[0] <= 192).all())
    assert out[1, :, 0].tolist() == [20] * 4  # B < m: the floor becomes B, so every layer keeps B
    assert out[2, :, 0].tolist() == [300] * 4  # keep >= context: everything
    # the ceiling is capped at the context length; the total is still met
    capped = alloc.allocate(_request([100], [120], 4), [])
    assert int(capped[0, :, 0].sum()) == 400 and int(capped.max()) <= 120
    with pytest.raises(InvalidParameterError, match="layers"):
        alloc.allocate(_request([64], [1000], 3), [])


def test_layer_then_head_split_keeps_layer_totals():
    e = torch.tensor([0.1, 0.9])
    layers = ErrorAwareLayerBudget(e, min_budget=8)
    alloc = LayerThenHeadBudget(layers, HeadAdaptiveBudget(alpha=0.2, window=4))
    seq = 100
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(1, 2, seq, generator=g) * torch.tensor([1.0, 5.0]).view(1, 2, 1) for _ in range(2)]
    positions = [torch.arange(seq).view(1, 1, seq).expand(1, 2, seq).clone() for _ in range(2)]
    req = BudgetRequest(torch.tensor([30]), torch.tensor([seq]), 2, 2, positions=positions)
    out = alloc.allocate(req, scores)
    layer_totals = layers.allocate(req, scores).sum(-1)
    assert torch.equal(out.sum(-1), layer_totals)
    assert int(out[0, 1, 1]) > int(out[0, 1, 0])  # AdaKV gives the higher-scoring head more
    assert UniformBudget().allocate(req, scores).sum() == out.sum()
