"""Block-wise iterative selection (KeyDiff's block prompt processing, arXiv 2504.15364; kvpress's BlockPress)."""

from __future__ import annotations

import math

import pytest
import torch

from kvtrim.errors import InvalidParameterError
from kvtrim.scoring.base import LayerView
from kvtrim.scoring.key_diff import KeyDiffScorer, key_diff_scores
from kvtrim.scoring.key_norm import KeyNormScorer
from kvtrim.scoring.reconstruction import ReconstructionScorer
from kvtrim.selection.block_iterative import BlockIterativeSelector


def _view(keys: torch.Tensor, positions: torch.Tensor) -> LayerView:
    return LayerView(
        layer_idx=0, num_layers=1, keys=keys, values=torch.zeros_like(keys), positions=positions,
        context_lengths=positions.amax(dim=(1, 2)) + 1, observation=None, stats={}, module=None, scaling=1.0,
    )


def _kept(sel, positions):
    b, h = sel.indices.shape[:2]
    return [[sorted(positions[i, j][sel.indices[i, j][sel.keep_mask[i, j]]].tolist()) for j in range(h)]
            for i in range(b)]


def _reference(keys: torch.Tensor, n: int, block: int) -> list[int]:
    """Block processing written out on one head's ``[seq, dim]`` keys: gather, score, keep the best ``n``."""
    kept = list(range(n))
    for start in range(n, keys.shape[0], block):
        cur = kept + list(range(start, min(start + block, keys.shape[0])))
        s = key_diff_scores(keys[cur][None, None], torch.ones(1, 1, len(cur), dtype=torch.bool))[0, 0]
        kept = [cur[i] for i in s.argsort(descending=True, stable=True)[:n].tolist()]
    return sorted(kept)


def _unit(degrees: float) -> torch.Tensor:
    return torch.tensor([math.cos(math.radians(degrees)), math.sin(math.radians(degrees))])


def test_each_block_is_scored_with_what_is_kept_so_far_not_with_the_whole_context():
    # Keys at these angles; budget 2, blocks of 2. Over the whole context the anchor (mean direction) is about
    # 55°, so the two keys furthest from it are 0° and 10°. In blocks: {0°, 10°} + {20°, 90°} have an anchor near
    # 30°, so 90° joins 0°; the later keys (80°, 85°, 88°, 70°) sit between those two and never displace them.
    keys = torch.stack([_unit(a) for a in (0, 10, 20, 90, 80, 85, 88, 70)])[None, None]
    positions = torch.arange(8).view(1, 1, 8)
    sel = BlockIterativeSelector(KeyDiffScorer(), block=2).select(_view(keys, positions), None, torch.tensor([[2]]))
    assert _kept(sel, positions) == [[[0, 3]]]
    whole = key_diff_scores(keys, torch.ones(1, 1, 8, dtype=torch.bool))
    assert sorted(whole[0, 0].topk(2).indices.tolist()) == [0, 1]


@pytest.mark.parametrize("block", [1, 3, 16])
def test_random_keys_match_block_processing_written_out(block):
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 3, 40, 8, generator=g) + torch.randn(2, 3, 1, 8, generator=g)
    positions = torch.arange(40).view(1, 1, 40).expand(2, 3, 40).clone()
    budgets = torch.tensor([[5, 11, 20], [7, 7, 39]])
    sel = BlockIterativeSelector(KeyDiffScorer(), block=block).select(_view(keys, positions), None, budgets)
    kept = _kept(sel, positions)
    for i in range(2):
        for h in range(3):
            assert kept[i][h] == _reference(keys[i, h], int(budgets[i, h]), block)
    # the block order matters for KeyDiff: one top-k over the whole context keeps other entries somewhere
    whole = key_diff_scores(keys, torch.ones(2, 3, 40, dtype=torch.bool))
    tops = [[sorted(whole[i, h].topk(int(budgets[i, h])).indices.tolist()) for h in range(3)] for i in range(2)]
    assert tops != kept


def test_a_per_entry_score_gives_one_top_k_over_the_context():
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 2, 30, 4, generator=g)
    positions = torch.arange(30).view(1, 1, 30).expand(1, 2, 30).clone()
    budgets = torch.tensor([[6, 13]])
    sel = BlockIterativeSelector(KeyNormScorer(), block=4).select(_view(keys, positions), None, budgets)
    norms = -keys.norm(dim=-1)
    assert _kept(sel, positions) == [[sorted(norms[0, h].topk(int(budgets[0, h])).indices.tolist())
                                      for h in range(2)]]


def test_padding_is_never_kept_and_blocks_count_stored_entries():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 1, 12, 4, generator=g)
    positions = torch.tensor([[[-1, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]])  # left padding
    sel = BlockIterativeSelector(KeyDiffScorer(), block=3).select(_view(keys, positions), None, torch.tensor([[4]]))
    assert _kept(sel, positions) == [[_reference(keys[0, 0, 2:], 4, 3)]]  # positions = index past the padding


def test_a_budget_at_the_stored_count_keeps_everything():
    keys = torch.randn(1, 2, 9, 4, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(9).view(1, 1, 9).expand(1, 2, 9).clone()
    sel = BlockIterativeSelector(KeyDiffScorer(), block=2).select(_view(keys, positions), None,
                                                                  torch.tensor([[9, 20]]))
    assert _kept(sel, positions) == [[list(range(9)), list(range(9))]]


def test_bad_block_and_cross_layer_scorers_are_refused():
    with pytest.raises(InvalidParameterError, match="block"):
        BlockIterativeSelector(KeyDiffScorer(), block=0)
    with pytest.raises(InvalidParameterError, match="prepare"):
        BlockIterativeSelector(ReconstructionScorer(), block=4)
