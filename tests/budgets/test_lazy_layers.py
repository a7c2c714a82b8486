"""SimLayerKV's lazy layers (arXiv 2410.13846): a layer whose last queries look at the two ends keeps only them."""

from __future__ import annotations

import pytest
import torch

from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.lazy_layers import LazyLayerBudget, lazy_layers
from kvtrim.errors import InvalidParameterError
from kvtrim.selection.topk import TopKSelector

POSITIONS = torch.arange(10).view(1, 1, 10).expand(2, 2, 10).clone()


def _attention(ends_mass: float) -> torch.Tensor:
    """``[1, 1, 10]`` probabilities: ``ends_mass`` spread over positions 0 and 7-9, the rest over 1-6."""
    p = torch.full((10,), (1.0 - ends_mass) / 6)
    p[[0, 7, 8, 9]] = ends_mass / 4
    return p.view(1, 1, 10)


def _request(keep: list[int], layers: int, positions=POSITIONS) -> BudgetRequest:
    return BudgetRequest(
        keep=torch.tensor(keep), context_lengths=torch.tensor([10] * len(keep)), num_layers=layers,
        kv_heads=positions.shape[1], positions=[positions] * layers,
    )


def test_a_layer_is_lazy_when_its_ends_hold_more_than_the_threshold():
    budget = LazyLayerBudget(threshold=0.9, n_initial=1, n_recent=3)
    # row 0: layer 0 pays 0.95 to the ends (lazy), layer 1 pays 0.5; row 1: the reverse
    layer0 = torch.cat([_attention(0.95).expand(1, 2, 10), _attention(0.5).expand(1, 2, 10)])
    layer1 = torch.cat([_attention(0.5).expand(1, 2, 10), _attention(0.95).expand(1, 2, 10)])
    counts = budget.allocate(_request([10, 10], 2), [layer0, layer1])
    assert counts.tolist() == [[[4, 4], [10, 10]], [[10, 10], [4, 4]]]


def test_the_mass_is_averaged_over_heads_and_the_threshold_is_strict():
    heads = torch.cat([_attention(1.0), _attention(0.8)], dim=1)  # mean 0.9
    assert lazy_layers([heads], [POSITIONS[:1]], torch.tensor([10]), 1, 3, 0.89).tolist() == [[True]]
    assert lazy_layers([heads], [POSITIONS[:1]], torch.tensor([10]), 1, 3, 0.91).tolist() == [[False]]
    assert LazyLayerBudget(threshold=1.0).keeps_below_request is False
    assert LazyLayerBudget(threshold=0.9).keeps_below_request is True


def test_the_selector_then_keeps_exactly_the_ends_of_a_lazy_layer():
    budget = LazyLayerBudget(threshold=0.9, n_initial=1, n_recent=3)
    scores = _attention(0.95).expand(1, 2, 10)
    counts = budget.allocate(_request([10], 1, POSITIONS[:1]), [scores])[:, 0]
    sel = TopKSelector(sink=1, recent=3).select_positions(POSITIONS[:1], scores, counts, torch.tensor([10]))
    assert sel.indices[0, 0][sel.keep_mask[0, 0]].tolist() == [0, 7, 8, 9]


def test_the_request_caps_every_layer_and_ends_longer_than_the_context_keep_it_all():
    budget = LazyLayerBudget(threshold=0.5, n_initial=4, n_recent=1024)
    scores = _attention(0.95).expand(1, 2, 10)
    assert budget.allocate(_request([10], 1, POSITIONS[:1]), [scores]).tolist() == [[[10, 10]]]
    tight = LazyLayerBudget(threshold=0.5, n_initial=1, n_recent=3)
    lazy_and_busy = [scores, _attention(0.1).expand(1, 2, 10)]
    assert tight.allocate(_request([3], 2, POSITIONS[:1]), lazy_and_busy).tolist() == [[[3, 3], [3, 3]]]


def test_padding_is_not_counted_in_the_ends():
    positions = torch.tensor([[[-1, -1, 0, 1, 2, 3, 4, 5, 6, 7]]])
    scores = torch.tensor([[[float("-inf")] * 2 + [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5]]])
    assert lazy_layers([scores], [positions], torch.tensor([8]), 1, 1, 0.99).tolist() == [[True]]


@pytest.mark.parametrize(
    ("params", "name"),
    [({"threshold": 1.5}, "threshold"), ({"threshold": -0.1}, "threshold"), ({"threshold": True}, "threshold"),
     ({"n_initial": -1}, "n_initial"), ({"n_recent": 2.0}, "n_recent")],
)
def test_bad_parameters_are_refused(params, name):
    with pytest.raises(InvalidParameterError, match=name):
        LazyLayerBudget(**params)
