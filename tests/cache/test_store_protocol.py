"""Every layer store implements the KVStore protocol; the callers' former layout branches are store methods."""

from __future__ import annotations

import pytest
import torch

from kvtrim.cache.channel_pruned import ChannelPrunedStore
from kvtrim.cache.dense import INVALID, DenseStore
from kvtrim.cache.ragged import RaggedStore
from kvtrim.cache.store import KVStore


def _dense(b=2, h=2, s=10, d=8) -> DenseStore:
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
    positions = torch.arange(s).expand(b, h, s).clone()
    positions[1, :, -3:] = INVALID  # row 1 holds 7 tokens
    return DenseStore(keys, values, positions, s)


def _ragged() -> RaggedStore:
    dense = _dense()
    keep = torch.ones(2, 2, 10, dtype=torch.bool)
    keep[0, 1, 6:] = False  # one head of row 0 keeps 6 entries
    keep[1, :, 7:] = False
    return RaggedStore.from_selection(dense, torch.arange(10).expand(2, 2, 10), keep)


def _pruned() -> ChannelPrunedStore:
    return ChannelPrunedStore.prune(_dense(), torch.tensor([0, 2, 5]).expand(2, 2, 3).contiguous())


@pytest.mark.parametrize("make", [_dense, _ragged, _pruned, lambda: DenseStore.empty(2, 2, 8, torch.float32, "cpu")])
def test_every_store_is_a_kvstore(make):
    assert isinstance(make(), KVStore)


def test_latest_positions():
    assert _dense().latest_positions().tolist() == [9, 6]
    assert _ragged().latest_positions().tolist() == [9, 6]
    assert _pruned().latest_positions().tolist() == [9, 6]
    assert DenseStore.empty(3, 2, 8, torch.float32, "cpu").latest_positions().tolist() == [-1, -1, -1]


def test_drop_last_removes_the_last_columns_and_never_goes_below_zero():
    dense = _dense()
    dense.drop_last(4)
    assert dense.length == 6
    ragged = _ragged()
    ragged.drop_last(7)  # the 6-entry head empties, the others keep what they held before the last 7 columns
    assert ragged.entries_per_head().tolist() == [[3, 0], [0, 0]]


def test_what_the_compressor_and_the_adapter_ask():
    empty = DenseStore.empty(1, 2, 8, torch.float32, "cpu")
    assert empty.causal_prefill_ready and not _dense().causal_prefill_ready and not _ragged().causal_prefill_ready
    assert _dense().to_dense().length == 10 and _ragged().to_dense().keys.shape[2] == 10
    assert _dense().rescorable and _ragged().rescorable and not _pruned().rescorable
