"""Per-partition top-k selection and the recursive frame."""

from __future__ import annotations

import torch

from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.partition import PartitionBudget, keep_per_partition
from kvtrim.scoring.base import LayerView
from kvtrim.scoring.observation import LayerObservation
from kvtrim.selection.partition import PartitionTopKSelector


def _view(positions, context, until=None, layer_idx=0):
    b, h, t = positions.shape
    return LayerView(
        layer_idx=layer_idx,
        num_layers=2,
        keys=torch.zeros(b, h, t, 4),
        values=torch.zeros(b, h, t, 4),
        positions=positions,
        context_lengths=context,
        observation=LayerObservation(),
        stats={},
        module=None,
        scaling=1.0,
        compressed_until=until,
    )


def test_keep_per_partition():
    assert [keep_per_partition(r, 128) for r in (0.5, 0.75, 0.875, 0.9, 0.0)] == [64, 32, 16, 12, 128]


def test_selects_top_k_of_each_partition_and_keeps_the_rest():
    sink, lag, t = 2, 5, 2 + 5 * 4 + 3  # 4 full partitions: 3 compressed, tail = 5 + 3
    positions = torch.arange(t).view(1, 1, t).expand(1, 2, t).clone()
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(1, 2, t, generator=g)
    view = _view(positions, torch.tensor([t]))
    request = BudgetRequest(
        keep=torch.tensor([t // 2]),
        context_lengths=torch.tensor([t]),
        num_layers=1,
        kv_heads=2,
        positions=[positions],
        ratio=0.6,
    )
    budgets = PartitionBudget(sink=sink, lag=lag).allocate(request, [scores])[:, 0]
    k = keep_per_partition(0.6, lag)  # 2
    assert budgets.tolist() == [[t - 3 * (lag - k)] * 2]
    sel = PartitionTopKSelector(sink=sink, lag=lag).select(view, scores, budgets)
    assert sel.compressed_until.tolist() == [sink + 3 * lag]
    for h in range(2):
        kept = set(sel.indices[0, h][sel.keep_mask[0, h]].tolist())
        assert set(range(sink)) <= kept
        assert set(range(sink + 3 * lag, t)) <= kept  # tail
        for p in range(3):
            block = list(range(sink + p * lag, sink + (p + 1) * lag))
            best = set(sorted(block, key=lambda i: -float(scores[0, h, i]))[:k])
            assert kept & set(block) == best
        assert sel.indices[0, h].tolist() == sorted(sel.indices[0, h].tolist())  # position order


def test_skip_layers_keep_everything():
    t = 40
    positions = torch.arange(t).view(1, 1, t)
    sel = PartitionTopKSelector(sink=0, lag=5, skip_layers=(1,)).select(
        _view(positions, torch.tensor([t]), layer_idx=1), torch.rand(1, 1, t), torch.tensor([[10]])
    )
    assert bool(sel.keep_mask.all()) and sel.indices.shape[-1] == t
