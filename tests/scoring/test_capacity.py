"""CapKV's capacity-aware scores (arXiv 2604.25975): query-weighted leverage of the values."""

from __future__ import annotations

import math

import pytest
import torch

from kvtrim.errors import InvalidParameterError
from kvtrim.scoring.capacity import CapacityScorer, capacity_scores

E1, E2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])


def _scores(keys, values, anchor, scored=None, tau=5.0, eps=0.0):
    keys, values = torch.stack(keys)[None, None], torch.stack(values)[None, None]
    scored = torch.ones(keys.shape[:3], dtype=torch.bool) if scored is None else torch.tensor([[scored]])
    return capacity_scores(keys, values, anchor.view(1, 1, -1), scored, tau, eps)[0, 0]


def test_copies_of_one_value_share_the_capacity_a_unique_value_keeps():
    # Every key equally aligned (w = 1). Values: two copies of 2·e1 and one 2·e2. A = I + 8·e1e1ᵀ + 4·e2e2ᵀ,
    # so a copy scores 4/9 and the unique value 4/5: leverage rewards the direction no other entry covers.
    s = _scores([E1, E1, E1], [2 * E1, 2 * E1, 2 * E2], anchor=E1)
    assert s.tolist() == pytest.approx([4 / 9, 4 / 9, 4 / 5])


def test_keys_the_anchor_points_at_weigh_more():
    # Orthogonal unit values; key 0 along the anchor (w = 1), key 1 orthogonal (w = e^-τ).
    tau = 2.0
    w = math.exp(-tau)
    s = _scores([E1, E2], [E1, E2], anchor=E1, tau=tau)
    assert s.tolist() == pytest.approx([1 / 2, w / (1 + w)])  # A = I + e1e1ᵀ + w·e2e2ᵀ
    # the weights only see directions: scaling a key or the anchor changes nothing
    assert _scores([3 * E1, 0.5 * E2], [E1, E2], anchor=7 * E1, tau=tau).tolist() == pytest.approx(s.tolist())


def test_entries_left_out_score_zero_and_take_no_capacity():
    s = _scores([E1, E1, E1], [2 * E1, 2 * E1, 2 * E2], anchor=E1, scored=[False, True, True])
    assert s.tolist() == pytest.approx([0.0, 4 / 5, 4 / 5])  # A = I + 4·e1e1ᵀ + 4·e2e2ᵀ
    none = _scores([E1, E2], [E1, E2], anchor=E1, scored=[False, False])
    assert none.tolist() == [0.0, 0.0]


def test_eps_adds_capacity_but_not_weight():
    s = _scores([E1, E2], [E1, E2], anchor=E1, tau=1e9, eps=1.0)  # w = (1, 0): A = I + 2·e1e1ᵀ + e2e2ᵀ
    assert s.tolist() == pytest.approx([1 / 3, 0.0])


def test_a_group_of_query_heads_averages_its_scores():
    keys = torch.stack([E1, E2])[None, None]
    values = torch.stack([E1, E2])[None, None]
    anchors = torch.stack([E1, E2])[None]  # two query heads on one KV head
    s = capacity_scores(keys, values, anchors, torch.ones(1, 1, 2, dtype=torch.bool), 1e9, 0.0)[0, 0]
    assert s.tolist() == pytest.approx([1 / 4, 1 / 4])  # each head: 1/2 for its own key, 0 for the other


@pytest.mark.parametrize(
    ("params", "name"),
    [({"tau": -1.0}, "tau"), ({"tau": math.inf}, "tau"), ({"eps": -1e-3}, "eps"), ({"n_future": 0}, "n_future"),
     ({"n_sink": -1}, "n_sink"), ({"n_sink": 1.5}, "n_sink")],
)
def test_bad_parameters_are_refused(params, name):
    with pytest.raises(InvalidParameterError, match=name):
        CapacityScorer(**params)
