"""AdaKV head-adaptive budgets."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.budgets.head_adaptive import HeadAdaptiveBudget, largest_remainder


def test_largest_remainder_is_exact():
    out = largest_remainder(torch.tensor([1.0, 1.0, 1.0]), 10)
    assert int(out.sum()) == 10 and sorted(out.tolist()) == [3, 3, 4]


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 6),
    seq=st.integers(20, 80),
    keep=st.integers(9, 40),
    seed=st.integers(0, 999),
    rule=st.sampled_from(["official", "kvpress"]),
)
def test_budgets_sum_to_layer_budget_and_respect_floor(heads, seq, keep, seed, rule):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(heads, seq, generator=g) ** 4  # skewed so heads differ
    positions = torch.arange(seq).expand(heads, seq)
    alloc = HeadAdaptiveBudget(alpha=0.2, window=8, rule=rule)
    keep = min(keep, seq)
    budgets = alloc.head_budgets(scores, positions, keep, seq)
    assert int(budgets.sum()) == heads * keep  # the layer total is exactly the uniform total
    per_head = keep - 8
    floor = int(0.2 * per_head) if rule == "official" else max(0, int(0.2 * keep) - 8)
    if per_head > 0:
        assert bool((budgets - 8 >= floor).all())  # the safeguard floor
    assert bool((budgets <= seq).all())


def test_skewed_heads_get_more():
    scores = torch.stack([torch.linspace(1, 0, 100), torch.full((100,), 0.001)])
    scores[0, :50] = 10.0
    budgets = HeadAdaptiveBudget(alpha=0.2, window=8).head_budgets(scores, torch.arange(100).expand(2, 100), 40, 100)
    assert budgets[0] > budgets[1] and int(budgets.sum()) == 80
    assert int(budgets[1]) - 8 >= int(0.2 * 32)
