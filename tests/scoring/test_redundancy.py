"""R-KV's redundancy term and score (kvtrim.scoring.redundancy) on hand-made keys."""

from __future__ import annotations

import pytest
import torch

from kvtrim.scoring.redundancy import RedundancyAwareScorer, key_redundancy


def _keys(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)[None, None]  # [1, 1, seq, d]


def test_copies_are_redundant_and_the_newest_copy_is_spared():
    # keys 0, 2 and 4 point the same way; 1 and 3 are orthogonal to everything
    keys = _keys([1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1], [1, 0, 0])
    red = key_redundancy(keys, torch.ones(1, 1, 5, dtype=torch.bool))[0, 0]
    assert torch.isclose(red.sum(), torch.tensor(1.0))
    assert red[0] > red[1] and red[2] > red[3]  # a copy is more redundant than a unique key
    # every row exempts its newest similar key: 0 and 2 exempt 4, 4 exempts 2, so 4 is counted least
    assert red[4] < red[2] and red[4] < red[0]
    assert torch.isclose(red[1], red[3])


def test_empty_slots_take_no_part_and_score_zero():
    keys = _keys([1, 0], [1, 0], [0, 1], [5, 5])
    valid = torch.tensor([[[True, True, True, False]]])
    red = key_redundancy(keys, valid)[0, 0]
    assert red[3] == 0 and torch.isclose(red[:3].sum(), torch.tensor(1.0))
    assert torch.allclose(red[:3], key_redundancy(keys[:, :, :3], valid[:, :, :3])[0, 0])


def test_row_blocks_do_not_change_the_result():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 37, 8, generator=g)
    keys[:, :, 20] = keys[:, :, 5] * 2  # some exact copies (cosine 1)
    valid = torch.rand(2, 3, 37, generator=g) > 0.1
    whole = key_redundancy(keys, valid, row_block=1024)
    torch.testing.assert_close(key_redundancy(keys, valid, row_block=5), whole)


def test_mix_weighs_importance_against_redundancy():
    with pytest.raises(ValueError, match="mix must be in"):
        RedundancyAwareScorer(mix=1.5)
    with pytest.raises(ValueError, match="threshold"):
        RedundancyAwareScorer(threshold=2.0)
    scorer = RedundancyAwareScorer(window=4, kernel=1, mix=0.0)
    assert scorer.observation.window == 4 and scorer.importance.group_reduce == "max"
