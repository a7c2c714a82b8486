"""PyramidKV layer budgets."""

from __future__ import annotations

from itertools import pairwise

import torch

from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.pyramid import PyramidBudget, pyramid_layer_budgets
from kvtrim.budgets.uniform import UniformBudget


def test_pyramid_shape_and_mean():
    budgets = pyramid_layer_budgets(keep=288, context=2000, num_layers=30, window=32, beta=20)
    b = 288 - 32
    assert budgets[0] == 2 * b - b // 20 + 32  # max_num + window at the bottom layer
    assert all(x >= y for x, y in pairwise(budgets))
    assert sum(budgets) == 288 * 30  # the mean is exactly the requested budget
    assert budgets[-1] - 32 in (b // 20, b // 20 + 1)


def test_pyramid_caps_at_context_and_falls_back():
    capped = pyramid_layer_budgets(keep=300, context=540, num_layers=4, window=32, beta=20)
    assert capped == [540, 380, 220, 60]  # max_num capped at context - window; min rises to keep the mean
    assert sum(pyramid_layer_budgets(51, 512, 30, 8, 20.0)) == 51 * 30  # floored steps would give a mean of 63
    assert pyramid_layer_budgets(keep=400, context=600, num_layers=4, window=32, beta=20) == [400] * 4  # T < 2b


def test_allocators_return_layer_head_grid():
    req = BudgetRequest(
        keep=torch.tensor([100, 40]), context_lengths=torch.tensor([1000, 40]), num_layers=3, kv_heads=2
    )
    uni = UniformBudget().allocate(req, [])
    assert uni.shape == (2, 3, 2) and bool((uni[0] == 100).all()) and bool((uni[1] == 40).all())
    pyr = PyramidBudget(window=8).allocate(req, [])
    assert pyr.shape == (2, 3, 2) and pyr[0, 0, 0] > pyr[0, 2, 0]
    assert bool((pyr[1] <= 40).all())
