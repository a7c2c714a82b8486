"""LagKV's lag-relative scorer."""

from __future__ import annotations

import pytest
import torch

from kvtrim.scoring.base import LayerView
from kvtrim.scoring.lag_relative import LagRelativeScorer
from kvtrim.scoring.observation import LayerObservation


def _view(keys, values, compressed_until=None):
    b, h, t, _ = keys.shape
    positions = torch.arange(t).expand(b, h, t).clone()
    return LayerView(
        layer_idx=0,
        num_layers=1,
        keys=keys,
        values=values,
        positions=positions,
        context_lengths=torch.full((b,), t),
        observation=LayerObservation(),
        stats={},
        module=None,
        scaling=1.0,
        compressed_until=compressed_until,
    )


def _reference(x, sink, lag, lagged=True):
    """Straightforward per-partition loop of the paper's score (for one [t, d] head)."""
    n = (x.shape[0] - sink) // lag
    out = torch.zeros(x.shape[0])
    for p in range(n - 1):
        cur = x[sink + p * lag : sink + (p + 1) * lag]
        ref = x[sink + (p + 1) * lag : sink + (p + 2) * lag] if lagged else cur
        lo, hi = ref.min(0).values, ref.max(0).values
        sd = ((cur - lo) / (hi - lo + 1e-6)).std(dim=1)
        out[sink + p * lag : sink + (p + 1) * lag] = torch.softmax(sd, 0)
    return out


@pytest.mark.parametrize("statistic", ["lag_std", "local_std"])
def test_matches_loop_reference(statistic):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 3, 90, 8, generator=g), torch.randn(2, 3, 90, 8, generator=g)
    scorer = LagRelativeScorer(sink=5, lag=16, statistic=statistic)
    got = scorer.score(_view(k, v))
    lagged = statistic == "lag_std"
    for b in range(2):
        for h in range(3):
            want = _reference(k[b, h], 5, 16, lagged) + _reference(v[b, h], 5, 16, lagged)
            torch.testing.assert_close(got[b, h], want)


def test_constant_channels_give_finite_scores():
    k = torch.ones(1, 2, 60, 4)
    k[..., 0] = 3.0  # constant channels: max == min in every partition
    scores = LagRelativeScorer(sink=4, lag=8).score(_view(k, k.clone()))
    assert torch.isfinite(scores).all()


def test_only_partitions_compressed_now_are_scored():
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 1, 100, 4, generator=g)
    scores = LagRelativeScorer(sink=4, lag=10).score(_view(k, k.clone(), compressed_until=torch.tensor([44])))
    assert (scores[..., :44] == 0).all()  # sink and already compressed part
    assert (scores[..., 44:84] > 0).all()  # 4 partitions compressed now (6 full partitions minus the last)
    assert (scores[..., 84:] == 0).all()  # tail


def test_key_norm_statistic_prefers_low_norm_keys():
    k = torch.ones(1, 1, 40, 4)
    k[0, 0, 10] = 0.01
    scores = LagRelativeScorer(sink=0, lag=10, statistic="key_norm").score(_view(k, k.clone()))
    assert int(scores[0, 0, :10].argmax()) == 0 or scores[0, 0, 10] == scores[0, 0, 10:20].max()
    assert scores[0, 0, 10] == scores[0, 0, 10:20].max()


def test_unknown_statistic():
    with pytest.raises(ValueError, match="statistic must be one of"):
        LagRelativeScorer(statistic="mean")
