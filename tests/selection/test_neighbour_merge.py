"""CaM's cache merging (Zhang et al., ICML 2024): evicted values join the kept entries after them, each merge drawn
with probability min(1, A_evicted / mean A_window)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvtrim
from conftest import tiny_model
from kvtrim.errors import InvalidParameterError
from kvtrim.methods import get_method
from kvtrim.selection.base import Selection
from kvtrim.selection.neighbour_merge import NeighbourMerge, merge_into_neighbours, merge_probabilities

# One head, positions 0..5 in slots 0..5; slots 1 and 4 evicted. With window 2, slot 1 merges into slots 2, 3
# and slot 4 into slot 5 (the only kept entry after it).
POS = torch.arange(6)[None, None]
KEPT = torch.tensor([[[True, False, True, True, False, True]]])
VALUES = torch.eye(6)[None, None]


def _probability(attention):
    p, *_ = merge_probabilities(torch.tensor(attention)[None, None], POS, ~KEPT, KEPT, window=2)
    return p[0, 0]


def test_the_merge_probability_is_the_attention_ratio_to_the_window_mean_clamped_to_one():
    # slot 1: 2 / mean(2, 6) = 0.5; slot 4: 3 / 3 -> 1; kept slots never merge
    assert torch.allclose(_probability([1.0, 2.0, 2.0, 6.0, 3.0, 3.0]), torch.tensor([0, 0.5, 0, 0, 1.0, 0]))
    assert torch.allclose(_probability([1.0, 9.0, 2.0, 6.0, 0.0, 3.0]), torch.tensor([0, 1.0, 0, 0, 0.0, 0]))


def test_an_evicted_entry_after_the_last_kept_one_has_no_window():
    kept = torch.tensor([[[True, True, True, False, False, False]]])
    p, start, end, _ = merge_probabilities(torch.ones(1, 1, 6), POS, ~kept, kept, window=4)
    assert torch.equal(p[0, 0], torch.zeros(6)) and torch.equal((end - start)[0, 0, 3:], torch.zeros(3).long())


def test_a_merge_adds_the_value_divided_by_the_window_size_to_each_entry_of_the_window():
    p, start, end, order = merge_probabilities(torch.ones(1, 1, 6), POS, ~KEPT, KEPT, window=2)
    out = merge_into_neighbours(VALUES, KEPT, p > 0, start, end, order)[0, 0]
    expected = torch.eye(6)
    expected[2, 1] = expected[3, 1] = 0.5  # slot 1 spread over its two neighbours
    expected[5, 4] = 1.0  # slot 4 into the one entry after it
    assert torch.allclose(out, expected)


def _view(attention, keep):
    h = attention.shape[1]
    return SimpleNamespace(
        keys=torch.zeros(1, h, 6, 2), values=VALUES.expand(1, h, 6, 6).clone(), positions=POS.expand(1, h, 6),
        valid=torch.ones(1, h, 6, dtype=torch.bool), stats={"attn_sum": attention}, layer_idx=0,
    )  # fmt: skip


def _selection(h):
    idx = torch.tensor([0, 2, 3, 5]).expand(1, h, 4)
    return Selection(idx, torch.ones_like(idx, dtype=torch.bool))


def test_merges_are_drawn_with_the_probability_and_repeat_with_the_seed():
    h = 2000  # many heads with the same entries: slot 1 merges with probability 0.5, slot 4 never
    attention = torch.tensor([1.0, 2.0, 2.0, 6.0, 0.0, 3.0]).expand(1, h, 6)
    out = NeighbourMerge(window=2, seed=3).merge(_view(attention, KEPT), _selection(h))
    merged = out[0, :, 2, 1] > 0  # slot 1's value reached slot 2
    assert torch.equal(out[0, :, 3, 1] > 0, merged) and abs(merged.float().mean().item() - 0.5) < 0.05
    assert torch.equal(out[0, :, 5, 4], torch.zeros(h))
    assert torch.equal(NeighbourMerge(window=2, seed=3).merge(_view(attention, KEPT), _selection(h)), out)
    assert not torch.equal(NeighbourMerge(window=2, seed=4).merge(_view(attention, KEPT), _selection(h)), out)


def test_long_sequences_match_the_rule_entry_by_entry():
    g = torch.Generator().manual_seed(0)
    s, w = 300, 5
    positions = torch.stack([torch.randperm(s, generator=g) for _ in range(2)])[None]  # slots not in position order
    kept = torch.rand(1, 2, s, generator=g) < 0.4
    values = torch.randn(1, 2, s, 3, generator=g)
    merged = (torch.rand(1, 2, s, generator=g) < 0.5) & ~kept
    attention = torch.rand(1, 2, s, generator=g)
    p, start, end, order = merge_probabilities(attention, positions, ~kept, kept, w)
    out = merge_into_neighbours(values, kept, merged & (p > 0), start, end, order)
    for h in range(2):
        pos, keep = positions[0, h], kept[0, h]
        ref = values[0, h].clone()
        for e in (~keep).nonzero().flatten().tolist():
            after = sorted((int(pos[t]), t) for t in keep.nonzero().flatten().tolist() if pos[t] > pos[e])[:w]
            if not after:
                assert p[0, h, e] == 0
                continue
            mean = sum(float(attention[0, h, t]) for _, t in after) / len(after)
            assert torch.isclose(p[0, h, e], torch.tensor(min(1.0, float(attention[0, h, e]) / mean)))
            if merged[0, h, e]:
                for _, t in after:
                    ref[t] += values[0, h, e] / len(after)
        assert torch.allclose(out[0, h], ref, atol=1e-5)


def test_cam_compacts_to_h2o_s_entries_with_merged_values():
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 200, (1, 64), generator=torch.Generator().manual_seed(1))
    caches = {m: kvtrim.make_cache(model, m, ratio=0.5) for m in ("cam", "h2o")}
    with torch.inference_mode():
        for cache in caches.values():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.compress()
    cam, h2o = caches["cam"].layers[0].store, caches["h2o"].layers[0].store
    assert torch.equal(cam.positions, h2o.positions) and torch.equal(cam.keys, h2o.keys)
    assert not torch.equal(cam.values, h2o.values)  # some evicted values were merged in
    assert cam.values.shape == h2o.values.shape


def test_cam_refuses_bad_parameters():
    with pytest.raises(InvalidParameterError, match="window must be an integer >= 1"):
        get_method("cam", window=0)
    with pytest.raises(InvalidParameterError, match="seed must be an integer >= 0"):
        get_method("cam", seed=-1)
    with pytest.raises(InvalidParameterError, match="base='cam' must name another registry method"):
        get_method("cam", base="cam")
