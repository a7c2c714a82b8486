"""TopKSelector: budgets, protected windows, empty slots."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.selection.topk import TopKSelector


def test_protected_sink_and_recent_windows_win():
    pos = torch.arange(20).view(1, 1, 20)
    scores = torch.linspace(1, 0, 20).view(1, 1, 20)  # earliest tokens score highest
    sel = TopKSelector(sink=2, recent=3).select_positions(pos, scores, torch.tensor([[8]]), torch.tensor([20]))
    kept = pos[0, 0, sel.indices[0, 0]][sel.keep_mask[0, 0]].tolist()
    assert kept == [0, 1, 2, 3, 4, 17, 18, 19]


def test_recent_fraction_of_budget():
    pos = torch.arange(40).view(1, 1, 40)
    scores = torch.zeros(1, 1, 40)
    scores[0, 0, :10] = torch.linspace(2, 1, 10)
    sel = TopKSelector(recent=0.5).select_positions(pos, scores, torch.tensor([[10]]), torch.tensor([40]))
    assert sel.indices[0, 0].tolist() == [0, 1, 2, 3, 4, 35, 36, 37, 38, 39]


@settings(max_examples=50, deadline=None)
@given(s=st.integers(2, 30), budget=st.integers(1, 40), holes=st.integers(0, 10), seed=st.integers(0, 999))
def test_empty_slots_never_displace_real_tokens(s, budget, holes, seed):
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(s).view(1, 1, s).repeat(1, 2, 1)
    hole_idx = torch.randperm(s, generator=g)[: min(holes, s - 1)]
    pos[:, :, hole_idx] = -1
    real = int((pos[0, 0] >= 0).sum())
    scores = torch.rand(1, 2, s, generator=g)
    budgets = torch.tensor([[budget, max(1, budget // 2)]])
    sel = TopKSelector(sink=1, recent=2).select_positions(pos, scores, budgets, torch.tensor([s]))
    for head in range(2):
        chosen = sel.indices[0, head][sel.keep_mask[0, head]]
        assert bool((pos[0, head, chosen] >= 0).all())
        assert len(chosen) == min(int(budgets[0, head]), real)
    assert bool((sel.indices.diff(dim=-1) > 0).all())  # ascending, unique
