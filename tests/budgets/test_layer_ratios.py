"""Per-layer fractions removed (kvpress's PerLayerCompressionPress)."""

from __future__ import annotations

import pytest
import torch

from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.layer_ratios import LayerRatioBudget
from kvtrim.errors import InvalidParameterError


def _request(keep: list[int], context: list[int], layers: int = 3) -> BudgetRequest:
    return BudgetRequest(
        keep=torch.tensor(keep), context_lengths=torch.tensor(context), num_layers=layers, kv_heads=2, ratio=0.5
    )


def test_each_layer_keeps_its_own_fraction_of_each_row():
    counts = LayerRatioBudget(ratios=(0.0, 0.5, 0.75)).allocate(_request([50, 10], [100, 20]), [])
    assert counts.shape == (2, 3, 2)
    assert counts[:, :, 0].tolist() == [[100, 50, 25], [20, 10, 5]]  # the request's keep (50, 10) is not used
    assert bool((counts[..., 0] == counts[..., 1]).all())


def test_no_ratios_is_the_request_and_only_set_ratios_ask_not_to_skip():
    counts = LayerRatioBudget().allocate(_request([50, 10], [100, 20]), [])
    assert counts[:, :, 0].tolist() == [[50, 50, 50], [10, 10, 10]]
    assert not LayerRatioBudget().keeps_below_request and not LayerRatioBudget(ratios=(0.0, 0.0)).keeps_below_request
    assert LayerRatioBudget(ratios=(0.0, 0.1)).keeps_below_request


def test_at_least_one_entry_is_kept():
    counts = LayerRatioBudget(ratios=(0.99, 0.99, 0.99)).allocate(_request([1], [10]), [])
    assert counts.min().item() == 1


@pytest.mark.parametrize("ratios", [(1.0,), (-0.1,), ("a",), (float("nan"),), 0.5])
def test_bad_ratios_are_refused(ratios):
    with pytest.raises(InvalidParameterError, match="ratios"):
        LayerRatioBudget(ratios=ratios)


def test_a_ratio_per_layer_is_required():
    with pytest.raises(InvalidParameterError, match="3 layers"):
        LayerRatioBudget(ratios=(0.5, 0.5)).allocate(_request([50], [100]), [])
