"""Entropy-gated chunk selection (kvpress's EntropyGatedChunkKV on ChunkKV, arXiv 2502.00299)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvtrim.errors import InvalidParameterError
from kvtrim.selection.entropy_chunk import EntropyGatedChunkSelector, gated_chunk_positions, normalized_entropy


def test_normalized_entropy_is_one_when_flat_and_zero_when_one_token_holds_the_mass():
    assert normalized_entropy(torch.ones(5)) == pytest.approx(1.0)
    assert normalized_entropy(torch.tensor([0.0, 0.0, 3.0, 0.0])) == pytest.approx(0.0, abs=1e-6)
    assert normalized_entropy(torch.tensor([7.0])) == 0.0
    # negative scores are shifted by the smallest: [-1, 1] reads as [0, 2]
    assert normalized_entropy(torch.tensor([-1.0, 1.0])) == pytest.approx(0.0, abs=1e-6)
    p = torch.tensor([0.5, 0.25, 0.25])
    assert normalized_entropy(p) == pytest.approx(float(-(p * p.log()).sum()) / math.log(3))


# Four chunks of 4 positions (0-3, 4-7, 8-11, 12-15); medians: mean 0.925 (lower of the middle two), entropy 0.76
#   A: (8, 0.5, 0, 0)          mean 2.125, entropy 0.16 -> important and spiky
#   B: (1.5, 1.6, 1.4, 1.5)    mean 1.5, entropy ~1     -> important and coherent
#   C: (1, 0.95, 0.9, 0.85)    mean 0.925, entropy ~1   -> at the median score, coherent
#   D: (0.1, 0.1, 0.05, 0)     mean 0.0625, entropy 0.76
SCORES = torch.tensor([8.0, 0.5, 0, 0, 1.5, 1.6, 1.4, 1.5, 1.0, 0.95, 0.9, 0.85, 0.1, 0.1, 0.05, 0])
POSITIONS = torch.arange(16)


def test_a_spiky_important_chunk_keeps_its_best_tokens_and_frees_the_rest_of_its_budget():
    kept = gated_chunk_positions(SCORES, POSITIONS, budget=10, chunk=4, spiky_keep=2)
    # A keeps its 2 best tokens, B is whole, C gets the 4 that are left
    assert kept.tolist() == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11]
    # Without the gate (spiky_keep = chunk) A would take 4 and C only 2
    whole = gated_chunk_positions(SCORES, POSITIONS, budget=10, chunk=4, spiky_keep=4)
    assert whole.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_exactly_the_budget_is_kept_topping_up_with_the_best_remaining_tokens():
    # budget 3: A gives 2 (spiky), B is cut to its best 1: 3 in all
    assert gated_chunk_positions(SCORES, POSITIONS, budget=3, chunk=4, spiky_keep=2).tolist() == [0, 1, 5]
    for budget in range(1, 17):
        assert gated_chunk_positions(SCORES, POSITIONS, budget, chunk=4, spiky_keep=1).numel() == budget
    # the spiky chunk (5, 0.1, 0) keeps 1 token, the other two are whole: 7 of 8, the best remaining token fills it
    scores = torch.tensor([5.0, 0.1, 0.0, 1.0, 1.0, 1.0, 0.3, 0.3, 0.2])
    kept = gated_chunk_positions(scores, torch.arange(9), budget=8, chunk=3, spiky_keep=1)
    assert kept.tolist() == [0, 1, 3, 4, 5, 6, 7, 8]


def test_nothing_is_evicted_when_the_budget_covers_the_tokens():
    assert gated_chunk_positions(SCORES, POSITIONS, budget=16, chunk=4, spiky_keep=2).tolist() == list(range(16))
    assert gated_chunk_positions(SCORES, POSITIONS, budget=0, chunk=4, spiky_keep=2).numel() == 0


def _view(positions, context):
    return SimpleNamespace(positions=positions, context_lengths=torch.tensor(context))


def test_the_selector_keeps_the_window_and_the_same_positions_in_every_head():
    # 2 heads, 20 positions; the scores summed over the heads are SCORES on positions 0-15, the window is 16-19
    per_head = torch.cat([SCORES, torch.zeros(4)]) / 2
    scores = torch.stack([per_head, per_head])[None]
    positions = torch.arange(20).expand(1, 2, 20)
    sel = EntropyGatedChunkSelector(chunk=4, spiky_keep=2, recent=4).select(
        _view(positions, [20]), scores, torch.tensor([[14, 14]])
    )
    kept = [sel.indices[0, h][sel.keep_mask[0, h]].tolist() for h in range(2)]
    assert kept[0] == kept[1] == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19]


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"chunk": 1}, "chunk"),
        ({"spiky_keep": 0}, "spiky_keep"),
        ({"chunk": 4, "spiky_keep": 4}, "spiky_keep"),
        ({"recent": -1}, "recent"),
    ],
)
def test_bad_parameters_are_refused(params, name):
    with pytest.raises(InvalidParameterError, match=name):
        EntropyGatedChunkSelector(**params)
