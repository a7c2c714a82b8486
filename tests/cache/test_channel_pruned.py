"""Channel-pruned key storage (ThinK): attention equals the pruned dot product, real bytes, appends, ragged rows."""

from __future__ import annotations

import pytest
import torch

from kvtrim.cache.channel_pruned import ChannelPrunedStore, gather_channels
from kvtrim.cache.dense import DenseStore
from kvtrim.cache.ragged import RaggedStore
from kvtrim.selection.key_channels import channel_scores


def _dense(b=2, h=2, s=12, d=8, seed=0) -> DenseStore:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, s, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g)
    pos = torch.arange(s).expand(b, h, s).clone()
    return DenseStore(k, v, pos, s)


def _random_channels(b, h, d, kept, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(d, generator=g)[:kept].sort().values for _ in range(b * h)]).view(b, h, kept)


def _zeroed(store: DenseStore, channels: torch.Tensor) -> DenseStore:
    """The same entries with every pruned key channel set to zero (the reference)."""
    keep = torch.zeros(*channels.shape[:2], store.keys.shape[-1], dtype=torch.bool).scatter_(2, channels, True)
    keys = store.keys * keep[:, :, None, :]
    return DenseStore(keys, store.values.clone(), store.positions.clone(), store.length)


def _manual(query, keys, values, channels, scaling):
    """softmax(q[kept] · k[kept] · scale) v, per query head, written out on hand-made tensors (GQA group 2)."""
    b, hq, tq, _ = query.shape
    group = hq // keys.shape[1]
    out = torch.empty(b, hq, tq, values.shape[-1])
    for bi in range(b):
        for qh in range(hq):
            ch = channels[bi, qh // group]
            logits = query[bi, qh][:, ch] @ keys[bi, qh // group][:, ch].T * scaling
            out[bi, qh] = torch.softmax(logits, -1) @ values[bi, qh // group]
    return out.transpose(1, 2)


def test_pruned_attention_equals_the_dot_product_over_kept_channels():
    dense = _dense()
    channels = _random_channels(2, 2, 8, 5)
    query = torch.randn(2, 4, 1, 8)
    qpos = torch.full((2, 1), 12)
    pruned = ChannelPrunedStore.prune(dense.copy(), channels)
    assert pruned.keys.shape == (2, 2, 12, 5) and pruned.values.shape == (2, 2, 12, 8)
    got = pruned.attend(query, qpos, 0.35, fresh_causal=False)
    torch.testing.assert_close(got, _manual(query, dense.keys, dense.values, channels, 0.35))
    torch.testing.assert_close(got, _zeroed(dense, channels).attend(query, qpos, 0.35, fresh_causal=False))


def test_no_channel_pruned_is_exact():
    dense = _dense()
    channels = torch.arange(8).expand(2, 2, 8).clone()
    query = torch.randn(2, 4, 3, 8)
    qpos = torch.tensor([[9, 10, 11], [9, 10, 11]])
    pruned = ChannelPrunedStore.prune(dense.copy(), channels)
    torch.testing.assert_close(pruned.attend(query, qpos, 0.3), dense.attend(query, qpos, 0.3, fresh_causal=False))


def test_bytes_come_from_the_thinner_key_tensor():
    dense = _dense(b=1, h=2, s=10, d=16)
    full_bytes = dense.nbytes()
    pruned = ChannelPrunedStore.prune(dense, _random_channels(1, 2, 16, 8))
    assert pruned.nbytes() == (1 * 2 * 10 * 8 + 1 * 2 * 10 * 16) * 4
    assert pruned.nbytes() == full_bytes * 3 // 4
    assert pruned.index_nbytes() == dense.index_nbytes() + 1 * 2 * 8 * 8  # + int64 channel indices
    assert pruned.entries() == 20 and pruned.entries_per_head().tolist() == [[10, 10]]


def test_appended_tokens_are_pruned_to_the_same_channels():
    dense = _dense(b=1, h=2, s=6, d=8)
    channels = _random_channels(1, 2, 8, 4)
    pruned = ChannelPrunedStore.prune(dense.copy(), channels)
    reference = _zeroed(dense, channels)
    new_k, new_v = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    positions = torch.tensor([[6, 7]])
    pruned.append(new_k, new_v, positions)
    keep = torch.zeros(1, 2, 8, dtype=torch.bool).scatter_(2, channels, True)
    reference.append(new_k * keep[:, :, None, :], new_v, positions)
    assert pruned.keys.shape == (1, 2, 8, 4)
    torch.testing.assert_close(pruned.keys[:, :, 6:], gather_channels(new_k, channels))
    query = torch.randn(1, 4, 2, 8)
    torch.testing.assert_close(pruned.attend(query, positions, 0.4), reference.attend(query, positions, 0.4, False))
    # rollback and batch selection keep channels and entries consistent
    mark = pruned.mark()
    pruned.append(new_k, new_v, torch.tensor([[8, 9]]))
    pruned.truncate_to(mark)
    assert pruned.entries() == 16
    copy = pruned.copy()
    copy.select_batch(torch.tensor([0, 0]))
    assert copy.channels.shape == (2, 2, 4) and copy.keys.shape == (2, 2, 8, 4)


def test_ragged_rows_with_their_own_channels():
    dense = _dense(b=1, h=2, s=10, d=8)
    indices = torch.tensor([[[0, 2, 4, 6, 8, 9], [1, 3, 5, 7, 9, 0]]]).sort(-1).values
    keep_mask = torch.tensor([[[True] * 6, [True, True, True, False, False, False]]])
    keep_mask = torch.gather(keep_mask, -1, torch.argsort(torch.argsort(indices, -1), -1))
    ragged = RaggedStore.from_selection(dense, indices, keep_mask)
    channels = _random_channels(1, 2, 8, 3)
    pruned = ChannelPrunedStore.prune(ragged.copy(), channels)
    assert pruned.layout == "ragged" and pruned.inner._k.shape == (9, 3)
    assert pruned.nbytes() == 9 * 3 * 4 + 9 * 8 * 4
    query = torch.randn(1, 4, 1, 8)
    qpos = torch.tensor([[10]])
    # reference: the padded dense copy of the ragged rows with pruned channels zeroed
    reference = _zeroed(ragged.to_dense(), channels)
    torch.testing.assert_close(pruned.attend(query, qpos, 0.5), reference.attend(query, qpos, 0.5, False))
    pruned.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), torch.tensor([[10]]))
    assert pruned.entries_per_head().tolist() == [[7, 4]]
    assert pruned.row_max_positions().tolist() == [10, 10]


def test_already_pruned_store_is_rejected():
    pruned = ChannelPrunedStore.prune(_dense(), _random_channels(2, 2, 8, 4))
    with pytest.raises(ValueError, match="already channel-pruned"):
        ChannelPrunedStore.prune(pruned, _random_channels(2, 2, 8, 4))


def test_channel_scores_are_thinks_frobenius_norms():
    g = torch.Generator().manual_seed(3)
    queries = torch.randn(1, 4, 5, 6, generator=g)  # 2 KV heads, group 2, window 5
    positions = torch.tensor([[-1, 10, 11, 12, 13]])  # the first window query is padding
    keys = torch.randn(1, 2, 9, 6, generator=g)
    kept = torch.ones(1, 2, 9, dtype=torch.bool)
    kept[0, 1, :3] = False
    got = channel_scores(queries, positions, keys, kept)
    for h in range(2):
        q = queries[0, 2 * h : 2 * h + 2, 1:].reshape(-1, 6)  # the group's real window queries stacked
        k = keys[0, h][kept[0, h]]
        for i in range(6):
            frob = torch.linalg.matrix_norm(torch.outer(q[:, i], k[:, i]))  # ‖Q[:, i] K[:, i]ᵀ‖_F
            torch.testing.assert_close(got[0, h, i], frob.square(), rtol=1e-5, atol=1e-6)
