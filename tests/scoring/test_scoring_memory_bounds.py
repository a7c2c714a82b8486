"""The memory bounds of the all-query observation and of ‖V·W_O‖₁ change chunk sizes, never results."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvtrim.cache.attention import low_precision_matmul
from kvtrim.scoring import observation, value_norm
from kvtrim.scoring.observation import LayerObservation, ObservationSpec, record
from kvtrim.scoring.value_norm import projected_value_norms


class _Store:
    def __init__(self, keys, positions):
        self.keys, self.positions, self.length, self.kv_heads = keys, positions, keys.shape[2], keys.shape[1]
        self._stats = {}

    def stat(self, name):
        if name not in self._stats:
            self._stats[name] = torch.zeros(self.positions.shape)
        return self._stats[name]


def _accumulate(seq=96, pad=5):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, seq, 16, generator=g)
    query = torch.randn(2, 4, seq, 16, generator=g) * 2
    positions = torch.arange(seq).view(1, 1, -1).repeat(2, 2, 1)
    positions[1, :, :pad] = -1  # a left-padded row
    positions[1, :, pad:] -= pad
    store = _Store(keys, positions)
    spec = ObservationSpec(accumulate=("attn_sum", "attn_sq_sum", "attn_band_sum"), chunk=64, band=8)
    record(spec, LayerObservation(), store, query, positions[:, 0], 0.25)
    return store._stats


def test_bounded_chunks_give_the_same_sums(monkeypatch):
    ref = _accumulate()
    # 2 rows x 4 heads x 96 slots per query: a bound of 16 queries' worth forces chunks of 16 (the floor)
    monkeypatch.setattr(observation, "MAX_CHUNK_PROBABILITIES", 2 * 4 * 96 * 16)
    small = _accumulate()
    for name in ref:
        torch.testing.assert_close(small[name], ref[name], rtol=1e-5, atol=1e-6)
        assert float(ref[name].sum()) > 0


def test_bounded_value_projection_gives_the_same_norms(monkeypatch):
    g = torch.Generator().manual_seed(1)
    values = torch.randn(2, 2, 40, 8, generator=g)
    weight = torch.randn(32, 4 * 8, generator=g)
    ref = projected_value_norms(values, weight, chunk=256)
    monkeypatch.setattr(value_norm, "MAX_PROJECTED", 2 * 4 * 32 * 3)  # three tokens per chunk
    torch.testing.assert_close(projected_value_norms(values, weight, chunk=256), ref)
    # the definition: mean over the group's query heads of ||v · W_O[h]||_1
    w = weight.view(32, 4, 8)
    direct = torch.stack([(values[:, 0] @ w[:, h].T).abs().sum(-1) for h in (0, 1)]).mean(0)
    torch.testing.assert_close(ref[:, 0], direct)


def test_low_precision_scoring_only_off_the_cpu():
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert not low_precision_matmul(bf16, bf16)  # the CPU keeps fp32 scoring
    fake_cuda = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda"))
    assert low_precision_matmul(fake_cuda, fake_cuda)
    assert not low_precision_matmul(fake_cuda, SimpleNamespace(dtype=torch.float32, device=torch.device("cuda")))


def test_bounded_squared_attention_chunks_give_the_same_metric(monkeypatch):
    from kvtrim.scoring import squared_attention as sq

    g = torch.Generator().manual_seed(2)
    query = torch.randn(1, 4, 80, 16, generator=g) * 2
    keys = torch.randn(1, 2, 80, 16, generator=g)
    kpos = torch.arange(80).view(1, 1, -1).repeat(1, 2, 1)
    ref = sq.squared_attention(query, kpos[:, 0], keys, kpos, 0.25, buffer=4, chunk=1024)
    monkeypatch.setattr(sq, "MAX_CHUNK_PROBABILITIES", 1 * 4 * 80 * 16)  # 16 queries per step
    torch.testing.assert_close(sq.squared_attention(query, kpos[:, 0], keys, kpos, 0.25, buffer=4, chunk=1024), ref)
    assert float(ref.sum()) > 0
