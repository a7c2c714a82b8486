"""RaggedStore: exact per-head storage; attention equals dense attention on the same kept entries."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dense import reference_attention

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


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
    """flash_attn_varlen_func's contract, one sequence at a time (non-causal): q ``[total_q, heads, d]``, k/v
    ``[total_k, heads_k, d]``; sequence ``i`` is rows ``cu[i]:cu[i+1]`` of each."""
    assert not causal and cu_q.dtype == cu_k.dtype == torch.int32 and len(cu_q) == len(cu_k)
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qa, qb, ka, kb = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert qb - qa <= max_q and kb - ka <= max_k
        if qb == qa or kb == ka:
            continue
        keys = k[ka:kb].repeat_interleave(group, 1).transpose(0, 1)  # [heads, n, d]
        vals = v[ka:kb].repeat_interleave(group, 1).transpose(0, 1)
        w = torch.softmax(q[qa:qb].transpose(0, 1) @ keys.transpose(1, 2) * softmax_scale, -1)
        out[qa:qb] = (w @ vals).transpose(0, 1)
    return out


def test_flash_varlen_arguments_describe_every_row_and_skip_the_slack():
    """The flash-attn decode path (CUDA only) is checked here against the kernel's contract: each row is one
    sequence, its slack a query-less one, and the result equals the batched padded path."""
    from kvtrim.cache.packed_attention import flash_varlen_attention

    dense = dense_store(2, 3, 12, 8, 5)
    indices, keep = random_selection(2, 3, 12, 5)
    ragged = RaggedStore.from_selection(dense, indices, keep)
    for step in range(3):  # appends give rows slack between them
        x = torch.randn(2, 3, 1, 8)
        ragged.append(x, x * 2, torch.full((2, 1), 12 + step))
    assert bool((ragged.capacity > ragged.length).any())
    q = torch.randn(2, 6, 1, 8)
    qpos = torch.full((2, 1), 20)
    got = flash_varlen_attention(
        q, ragged._k, ragged._v, ragged.start, ragged.length, ragged._width, 0.3, varlen_fn=reference_varlen
    )
    assert torch.allclose(got, ragged.attend(q, qpos, 0.3), atol=1e-5)
