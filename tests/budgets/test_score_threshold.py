"""DMS's threshold rule (arXiv 2506.05345): entries under the threshold leave once out of the recent window."""

from __future__ import annotations

import math

import pytest
import torch

from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.score_threshold import ScoreThresholdBudget
from kvtrim.errors import InvalidParameterError
from kvtrim.selection.topk import TopKSelector


def _request(keep: int, positions: torch.Tensor, context: int) -> BudgetRequest:
    return BudgetRequest(
        keep=torch.tensor([keep]), context_lengths=torch.tensor([context]), num_layers=1,
        kv_heads=positions.shape[1], positions=[positions],
    )


POSITIONS = torch.tensor([[[-1, 0, 1, 2, 3, 4, 5, 6], [-1, 0, 1, 2, 3, 4, 5, 6]]])  # one padding slot
SCORES = torch.tensor([[[9.0, 0.5, -1.0, 2.0, -3.0, 0.1, -5.0, -6.0], [9.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0]]])


def test_counts_are_the_entries_at_or_above_the_threshold_plus_the_window():
    budget = ScoreThresholdBudget(threshold=0.1, recent=2)
    counts = budget.allocate(_request(7, POSITIONS, 7), [SCORES])
    # head 0: 0.5, 2.0, 0.1 clear the threshold (positions 0, 2, 4) + window {5, 6}; padding never counts
    # head 1: none clears it before the window + window {5, 6}
    assert counts.tolist() == [[[5, 2]]]


def test_the_selector_then_keeps_exactly_the_window_and_the_entries_above_the_threshold():
    budget = ScoreThresholdBudget(threshold=0.1, recent=2)
    counts = budget.allocate(_request(7, POSITIONS, 7), [SCORES])[:, 0]
    sel = TopKSelector(recent=2).select_positions(POSITIONS, SCORES, counts, torch.tensor([7]))
    kept = [sorted(POSITIONS[0, h][sel.indices[0, h][sel.keep_mask[0, h]]].tolist()) for h in range(2)]
    assert kept == [[0, 2, 4, 5, 6], [5, 6]]


def test_the_requested_budget_caps_the_count_and_minus_infinity_keeps_everything():
    counts = ScoreThresholdBudget(threshold=0.1, recent=2).allocate(_request(3, POSITIONS, 7), [SCORES])
    assert counts.tolist() == [[[3, 2]]]
    counts = ScoreThresholdBudget(threshold=-math.inf, recent=0).allocate(_request(7, POSITIONS, 7), [SCORES])
    assert counts.tolist() == [[[7, 7]]]  # every real token, nothing evicted


@pytest.mark.parametrize(
    ("params", "match"),
    [({"threshold": float("nan")}, "threshold"), ({"threshold": "1"}, "threshold"), ({"recent": -1}, "recent")],
)
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(InvalidParameterError, match=match):
        ScoreThresholdBudget(**params)


def test_only_a_finite_threshold_asks_the_compressor_not_to_skip():
    assert ScoreThresholdBudget(threshold=0.0).keeps_below_request
    assert not ScoreThresholdBudget().keeps_below_request  # -inf: nothing below the request, skipping is exact
