"""Every chunk of positions keeps its own share (kvpress's ChunkPress)."""

from __future__ import annotations

import pytest
import torch

from kvtrim.errors import InvalidParameterError
from kvtrim.selection.chunk_quota import ChunkQuotaSelector, chunk_quota_mask


def test_each_chunk_keeps_its_share_of_its_best_entries():
    positions = torch.arange(8).view(1, 1, 8)
    # chunk 0 (positions 0-3) holds every high score; a global top-4 would empty chunk 1
    scores = torch.tensor([[[9.0, 8.0, 7.0, 6.0, 1.0, 3.0, 2.0, 0.0]]])
    keep = chunk_quota_mask(positions, scores, torch.tensor([[4]]), chunk=4)
    assert keep[0, 0].nonzero().flatten().tolist() == [0, 1, 5, 6]


def test_chunks_are_chunks_of_positions_padding_and_gaps_included():
    positions = torch.tensor([[[-1, -1, 0, 1, 2, 5, 6, 7]]])  # left padding, positions 3-4 evicted before
    scores = torch.tensor([[[99.0, 99.0, 1.0, 2.0, 3.0, 4.0, 6.0, 5.0]]])
    keep = chunk_quota_mask(positions, scores, torch.tensor([[3]]), chunk=4)
    # chunk {0,1,2} holds 3 of the 6 stored entries: quota floor(3·3/6) = 1 → position 2; chunk {5,6,7}: 1 → 6
    assert keep[0, 0].tolist() == [False, False, False, False, True, False, True, False]


def test_budget_at_the_stored_count_keeps_everything_and_at_least_one_per_chunk():
    positions = torch.arange(10).view(1, 1, 10)
    scores = torch.randn(1, 1, 10, generator=torch.Generator().manual_seed(0))
    assert bool(chunk_quota_mask(positions, scores, torch.tensor([[10]]), chunk=3).all())
    keep = chunk_quota_mask(positions, scores, torch.tensor([[1]]), chunk=3)
    assert keep.sum().item() == 4  # 4 chunks (3, 3, 3, 1 positions), at least one each


def test_selection_is_ascending_and_masks_what_a_head_does_not_keep():
    positions = torch.arange(6).view(1, 1, 6).expand(1, 2, 6)
    scores = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]]])

    class View:
        pass

    view = View()
    view.positions = positions
    sel = ChunkQuotaSelector(chunk=3).select(view, scores, torch.tensor([[2, 4]]))
    kept = [sel.indices[0, h][sel.keep_mask[0, h]].tolist() for h in range(2)]
    assert kept == [[2, 5], [0, 1, 3, 4]]


def test_bad_chunk_is_refused():
    with pytest.raises(InvalidParameterError, match="chunk"):
        ChunkQuotaSelector(chunk=0)
