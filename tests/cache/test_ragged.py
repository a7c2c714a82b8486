"""RaggedStore: exact per-head storage; attention equals dense attention on the same kept entries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dense import reference_attention

import paged_kernel_reference as ref
from kvtrim.cache.dense import DenseStore
from kvtrim.cache.ragged import RaggedStore


def dense_store(b, h, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    store = DenseStore.empty(b, h, d, torch.float32, "cpu")
    store.append(
        torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g), torch.arange(s).expand(b, s)
    )
    return store


def random_selection(b, h, s, seed):
    g = torch.Generator().manual_seed(seed)
    k = s
    indices = torch.stack(
        [torch.stack([torch.randperm(s, generator=g)[:k].sort().values for _ in range(h)]) for _ in range(b)]
    )
    counts = torch.randint(1, s + 1, (b, h), generator=g)
    keep = torch.arange(k)[None, None, :] < counts[..., None]
    # keep the first `count` of a random permutation, re-sorted
    keep = torch.gather(keep, -1, torch.argsort(torch.rand(b, h, k, generator=g), dim=-1))
    return indices, keep


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    group=st.integers(1, 3),
    s=st.integers(1, 24),
    tq=st.integers(1, 3),
    seed=st.integers(0, 9999),
)
def test_ragged_attention_equals_masked_dense_reference(b, h, group, s, tq, seed):
    dense = dense_store(b, h, s, 8, seed)
    indices, keep = random_selection(b, h, s, seed)
    ragged = RaggedStore.from_selection(dense, indices, keep)
    reference = dense.copy()
    reference.keep(indices, keep)  # same entries, padded layout with empty slots
    assert torch.equal(ragged.entries_per_head(), keep.sum(-1))
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(b, h * group, tq, 8, generator=g)
    # A single query is a decoding step: the newest token, after every stored one (the stores' contract).
    qpos = torch.randint(s if tq == 1 else 0, s + 3, (b, tq), generator=g)
    out = ragged.attend(q, qpos, 0.35)
    ref = reference_attention(q, reference.keys, reference.values, reference.positions, qpos, 0.35)
    assert torch.allclose(out, ref, atol=1e-5)
    # The dense store holding the same entries (padded) gives the same result, by the same contract.
    assert torch.allclose(out, reference.attend(q, qpos, 0.35, fresh_causal=False), atol=1e-5)


def test_bytes_equal_kept_entries_then_bounded_slack():
    dense = dense_store(2, 3, 40, 16, 0)
    counts = torch.tensor([[5, 17, 40], [1, 2, 3]])
    keep = torch.arange(40)[None, None] < counts[..., None]
    ragged = RaggedStore.from_selection(dense, torch.arange(40).expand(2, 3, 40), keep)
    kept = int(counts.sum())
    assert ragged.entries() == kept
    assert ragged.nbytes() == kept * 16 * 4 * 2  # exactly the kept entries, K and V in fp32
    for step in range(30):
        one = torch.randn(2, 3, 1, 16)
        ragged.append(one, one, torch.full((2, 1), 40 + step))
    assert torch.equal(ragged.entries_per_head(), counts + 30)
    slack = ragged.capacity - ragged.length
    assert bool((slack >= 0).all())
    # slack per row is bounded by max(16, capacity/8) plus one append
    assert bool((slack <= torch.clamp((ragged.length * 9) // 8 - ragged.length, min=16) + 1).all())


def test_appends_write_in_place_until_a_row_is_full():
    dense = dense_store(1, 2, 10, 4, 1)
    keep = torch.ones(1, 2, 10, dtype=torch.bool)
    ragged = RaggedStore.from_selection(dense, torch.arange(10).expand(1, 2, 10), keep)
    one = torch.randn(1, 2, 1, 4)
    ragged.append(one, one, torch.tensor([[10]]))  # first append grows (no slack after compaction)
    buffer = ragged._k.data_ptr()
    for step in range(15):
        ragged.append(one, one, torch.tensor([[11 + step]]))
    assert ragged._k.data_ptr() == buffer  # 15 more appends fit the slack: no reallocation, no copy
    k, _, pos = ragged.row(0, 1)
    assert pos.tolist() == list(range(26)) and torch.equal(k[-1], one[0, 1, 0])


def test_padding_is_not_stored_and_rollback():
    dense = dense_store(2, 1, 6, 4, 2)
    ragged = RaggedStore.from_selection(dense, torch.arange(6).expand(2, 1, 6), torch.ones(2, 1, 6, dtype=torch.bool))
    mark = ragged.mark()
    x = torch.randn(2, 1, 3, 4)
    ragged.append(x, x, torch.tensor([[-1, 6, 7], [6, 7, 8]]))  # row 0 has one padding token
    assert ragged.entries_per_head().view(-1).tolist() == [8, 9]
    ragged.truncate_to(mark)
    assert ragged.entries_per_head().view(-1).tolist() == [6, 6]


def test_to_dense_round_trip_and_select_batch():
    dense = dense_store(2, 2, 8, 4, 3)
    indices, keep = random_selection(2, 2, 8, 3)
    ragged = RaggedStore.from_selection(dense, indices, keep)
    back = ragged.to_dense()
    assert torch.equal(back.entries_per_head(), ragged.entries_per_head())
    for b in range(2):
        for h in range(2):
            k, _, pos = ragged.row(b, h)
            valid = back.positions[b, h] >= 0
            assert torch.equal(back.keys[b, h][valid], k) and torch.equal(back.positions[b, h][valid], pos)
    swapped = ragged.copy()
    swapped.select_batch(torch.tensor([1, 0]))
    assert torch.equal(swapped.entries_per_head(), ragged.entries_per_head().flip(0))


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(3, 3), (6, 3), (8, 2), (8, 1)])
def test_flash_varlen_layout_is_legal_for_flash_attn_and_equals_the_padded_path(q_heads, kv_heads):
    """The flash-attn decode path (CUDA only) is checked here against flash-attn 2's varlen contract, its shape rules
    included (tests/paged_kernel_reference.py): each row is one sequence and its slack another, every sequence has one
    query (GQA with one query per sequence views q as [sequences, kv_heads, group, d]), and the result equals the
    batched padded path on the same kept entries."""
    from kvtrim.cache.packed_attention import flash_varlen_attention

    d = 16
    dense = dense_store(2, kv_heads, 12, d, 5)
    indices, keep = random_selection(2, kv_heads, 12, 5)
    ragged = RaggedStore.from_selection(dense, indices, keep)
    for step in range(3):  # appends give rows slack between them
        x = torch.randn(2, kv_heads, 1, d)
        ragged.append(x, x * 2, torch.full((2, 1), 12 + step))
    assert bool((ragged.capacity > ragged.length).any())
    q = torch.randn(2, q_heads, 1, d)
    qpos = torch.full((2, 1), 20)
    got = flash_varlen_attention(
        q, ragged._k, ragged._v, ragged.start, ragged.length, ragged._width, 0.3, varlen_fn=ref.reference_varlen
    )
    assert torch.allclose(got, ragged.attend(q, qpos, 0.3), atol=1e-5)


def test_reference_varlen_enforces_the_one_query_gqa_view():
    """flash-attn 2 with max_seqlen_q == 1 and more query heads than KV heads reads sequence b's query from row b: a
    sequence without a query (a slack sequence with cu_seqlens_q repeating an offset) cannot be described."""
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(10, 1, 8, generator=g), torch.randn(10, 1, 8, generator=g)
    cu_k = torch.tensor([0, 4, 6, 10], dtype=torch.int32)
    q = torch.randn(2, 2, 8, generator=g)  # two queries with two heads each over one KV head
    with pytest.raises(RuntimeError, match=r"shape '\[3, 1, 2, 8\]' is invalid"):
        ref.reference_varlen(q, k, v, torch.tensor([0, 1, 1, 2], dtype=torch.int32), cu_k, 1, 4)
    q3 = torch.cat([q[:1], q[:1], q[1:]])  # one query per sequence: legal
    out = ref.reference_varlen(q3, k, v, torch.arange(4, dtype=torch.int32), cu_k, 1, 4, softmax_scale=0.5)
    for row, (a, b) in zip((0, 2), ((0, 4), (6, 10)), strict=True):
        w = torch.softmax(q3[row] @ k[a:b, 0].T * 0.5, -1)
        torch.testing.assert_close(out[row], w @ v[a:b, 0])
    mha = ref.reference_varlen(q[:, :1], k, v, torch.tensor([0, 1, 1, 2], dtype=torch.int32), cu_k, 1, 4)
    assert mha.shape == (2, 1, 8)  # one query head per KV head: no view, a query-less sequence is fine
    with pytest.raises(RuntimeError, match="head_size that is a multiple of 8"):
        ref.reference_varlen(q[..., :6], k[..., :6], v[..., :6], torch.arange(4, dtype=torch.int32), cu_k, 1, 4)
