"""The lag frame: partition arithmetic (LagKV eq. 12) and the gather/scatter round trip."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.scoring.partitions import kept_length, partition_layout


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 3000), sink=st.integers(0, 40), lag=st.integers(1, 200), r=st.floats(0.0, 1.0))
def test_layout_counts_match_eq12(total, sink, lag, r):
    k = int(r * lag)
    positions = torch.arange(total).view(1, 1, total)
    layout = partition_layout(positions, torch.tensor([total]), None, sink, lag)
    n = max(total - sink, 0) // lag
    assert int(layout.full) == n
    assert int(layout.compress) == max(n - 1, 0)
    compressible = int(layout.compressible.sum())
    assert compressible == max(n - 1, 0) * lag
    # Kept entries if every compressed partition keeps k: the paper's S + (n-1)k + L + rem.
    assert total - compressible + max(n - 1, 0) * k == kept_length(total, sink, lag, k)
    assert int(layout.new_start) == (sink + max(n - 1, 0) * lag if total >= sink else sink)


def test_kept_length_examples():
    assert kept_length(1024, 16, 128, 64) == 16 + 6 * 64 + 128 + 112
    assert kept_length(16 + 2 * 128 - 1, 16, 128, 64) == 16 + 2 * 128 - 1  # fewer than two partitions: all kept
    assert kept_length(16 + 2 * 128, 16, 128, 32) == 16 + 32 + 128


def test_layout_respects_compressed_until_and_padding():
    # Row 0: 3 left-padding slots then positions 0..99; row 1: positions 0..102. Row 0 already compressed to 40.
    pos = torch.stack([torch.cat([torch.full((3,), -1), torch.arange(100)]), torch.arange(103)]).view(2, 1, 103)
    layout = partition_layout(pos, torch.tensor([100, 103]), torch.tensor([40, 4]), sink=4, lag=20)
    assert layout.full.tolist() == [3, 4]
    assert layout.compress.tolist() == [2, 3]
    assert layout.new_start.tolist() == [80, 64]
    assert not bool(layout.compressible[0, 0, :3].any())  # padding
    assert not bool(layout.compressible[0, 0, 3 : 3 + 40].any())  # already compressed
    assert bool(layout.compressible[0, 0, 3 + 40 : 3 + 80].all())


def test_gather_and_scatter_back_round_trip():
    total, lag, sink = 70, 16, 3
    g = torch.Generator().manual_seed(0)
    # Shuffle the slots: the frame follows positions, not slot order.
    perm = torch.randperm(total, generator=g)
    pos = perm.view(1, 1, total).expand(1, 2, total).clone()
    x = pos.float().unsqueeze(-1)  # the value of a slot is its position
    layout = partition_layout(pos, torch.tensor([total]), None, sink, lag)
    parts = layout.gather(x)  # [1, 2, n, lag, 1]
    n = (total - sink) // lag
    assert parts.shape == (1, 2, n, lag, 1)
    expected = torch.arange(sink, sink + n * lag).float().view(n, lag)
    assert torch.equal(parts[0, 0, :, :, 0], expected)
    back = layout.scatter_back(parts[..., 0][:, :, : n - 1], fill=-1.0)
    assert torch.equal(back, torch.where(layout.compressible, pos.float(), torch.tensor(-1.0)))
