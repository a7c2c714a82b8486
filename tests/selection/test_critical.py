"""CriticalKV two-stage selection."""

from __future__ import annotations

import torch
from torch import nn

from kvtrim.scoring.value_norm import projected_value_norms
from kvtrim.selection.critical import CriticalSelector


class FakeView:
    def __init__(self, positions, values, o_proj):
        self.positions = positions
        self.values = values
        self.module = nn.Module()
        self.module.o_proj = o_proj
        self.context_lengths = positions.amax(dim=(1, 2)) + 1


def test_projected_value_norm_matches_direct_computation():
    torch.manual_seed(0)
    b, hkv, group, s, d, hidden = 2, 2, 3, 11, 4, 10
    values = torch.randn(b, hkv, s, d)
    o_proj = nn.Linear(hkv * group * d, hidden, bias=False)
    norms = projected_value_norms(values, o_proj.weight, chunk=4)
    w = o_proj.weight  # [hidden, q_heads * d]
    for g in range(hkv):
        direct = torch.stack(
            [(values[:, g] @ w[:, (g * group + j) * d : (g * group + j + 1) * d].T).abs().sum(-1) for j in range(group)]
        ).mean(0)
        assert torch.allclose(norms[:, g], direct, atol=1e-5)


def test_stage_one_entries_are_always_kept():
    torch.manual_seed(1)
    s, d = 40, 4
    positions = torch.arange(s).view(1, 1, s)
    values = torch.randn(1, 1, s, d)
    values[0, 0, :10] *= 1e-3  # the highest-attention tokens have tiny values
    o_proj = nn.Linear(d, 8, bias=False)
    scores = torch.linspace(1, 0.01, s).view(1, 1, s)
    view = FakeView(positions, values, o_proj)
    selector = CriticalSelector(alpha=0.5, recent=2)
    budgets = torch.tensor([[12]])
    _, stage1 = selector.stage_scores(view, scores, budgets)
    assert int(stage1.sum()) == 6  # floor(0.5 * 12), the protected window ranks first
    assert bool(stage1[0, 0, 38:].all())
    sel = selector.select(view, scores, budgets)
    kept = set(sel.indices[0, 0][sel.keep_mask[0, 0]].tolist())
    assert len(kept) == 12
    assert set(torch.nonzero(stage1[0, 0]).view(-1).tolist()) <= kept
    assert {38, 39} <= kept
    # stage 2 prefers large projected values over the tiny-value high-attention tokens 4..9
    assert not {4, 5, 6, 7, 8, 9} <= kept
