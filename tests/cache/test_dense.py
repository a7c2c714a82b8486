"""DenseStore: appends, compaction, byte accounting, and attention equal to a masked reference."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.cache.attention import grouped_attention
from kvtrim.cache.dense import DenseStore


def reference_attention(query, keys, values, kpos, qpos, scaling):
    """Naive masked attention with KV heads repeated (transformers' repeat_kv layout)."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    pos = kpos.repeat_interleave(group, dim=1)  # [b, hq, s]
    logits = query @ k.transpose(-1, -2) * scaling
    visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= qpos[:, None, :, None])
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2)


def make_store(b=2, h=2, s=12, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    store = DenseStore.empty(b, h, d, torch.float32, "cpu")
    k = torch.randn(b, h, s, d, generator=g)
    v = torch.randn(b, h, s, d, generator=g)
    store.append(k, v, torch.arange(s).expand(b, s))
    return store, k, v


def test_append_keeps_order_and_positions():
    store, k, v = make_store()
    assert store.length == 12
    assert torch.equal(store.keys, k) and torch.equal(store.values, v)
    assert store.positions[0, 0].tolist() == list(range(12))
    assert store.entries() == 2 * 2 * 12


def test_keep_reallocates_exactly_and_counts_bytes():
    store, k, _ = make_store()
    idx = torch.tensor([1, 4, 7, 11]).expand(2, 2, 4)
    store.keep(idx)
    assert store.capacity == 4 and store.length == 4
    assert torch.equal(store.keys[:, :, 1], k[:, :, 4])
    assert store.nbytes() == 2 * (2 * 2 * 4 * 8 * 4)  # K and V, fp32
    assert store.positions[0, 1].tolist() == [1, 4, 7, 11]


def test_keep_mask_empties_slots_beyond_budget():
    store, _, _ = make_store()
    idx = torch.tensor([0, 5, 9]).expand(2, 2, 3)
    mask = torch.ones(2, 2, 3, dtype=torch.bool)
    mask[1, 0, 2] = False
    store.keep(idx, mask)
    assert store.entries_per_head().tolist() == [[3, 3], [2, 3]]
    assert store.positions[1, 0, 2] == -1


def test_decode_appends_grow_geometrically_not_per_step():
    store, _, _ = make_store(s=100)
    store.keep(torch.arange(0, 100, 2).expand(2, 2, 50))
    caps = set()
    for step in range(200):
        one = torch.randn(2, 2, 1, 8)
        store.append(one, one, torch.full((2, 1), 100 + step))
        caps.add(store.capacity)
    assert store.length == 250
    assert len(caps) <= 15  # reallocations are rare, each adds >= 1/8 of the capacity


def test_truncate_removes_tail():
    store, _, _ = make_store()
    store.truncate(5)
    assert store.length == 5 and store.entries() == 2 * 2 * 5


def test_copy_is_independent():
    store, _, _ = make_store()
    other = store.copy()
    other.keep(torch.arange(3).expand(2, 2, 3))
    assert store.length == 12 and other.length == 3


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3),
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    s=st.integers(1, 20),
    tq=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_masked_grouped_attention_matches_reference(b, hkv, group, s, tq, seed):
    g = torch.Generator().manual_seed(seed)
    d = 8
    q = torch.randn(b, hkv * group, tq, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    # Random per-head positions with holes (-1) as after per-head eviction.
    kpos = torch.randint(-1, 30, (b, hkv, s), generator=g)
    qpos = torch.randint(0, 35, (b, tq), generator=g)
    mask = (kpos[:, :, None, :] >= 0) & (kpos[:, :, None, :] <= qpos[:, None, :, None])
    out = grouped_attention(q, k, v, mask, 0.3)
    ref = reference_attention(q, k, v, kpos, qpos, 0.3)
    assert torch.allclose(out, ref, atol=1e-5)
    assert not torch.isnan(out).any()


def test_store_attend_decode_fast_path_equals_masked_path():
    store, _, _ = make_store(b=1, h=2, s=10)
    q = torch.randn(1, 4, 1, 8)
    qpos = torch.tensor([[10]])
    fast = store.attend(q, qpos, 0.25, fresh_causal=False)
    ref = reference_attention(q, store.keys, store.values, store.positions, qpos, 0.25)
    assert torch.allclose(fast, ref, atol=1e-6)
