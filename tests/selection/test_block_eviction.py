"""KV-Compress block ranking, eviction scheduling and the MoveCache reorganization."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvtrim.cache.paged import BlockPool, PagedSequence
from kvtrim.errors import InvalidParameterError
from kvtrim.selection.block_eviction import (
    apply_evictions,
    block_eviction_counts,
    blocks_over_budget,
    compress_sequence,
    compress_sequences,
    evicted_entries,
    schedule_evictions,
)

torch.set_num_threads(1)
INF = float("inf")


def test_block_metric_hand_example():
    # block size 4. Row 0: 6 entries (hanging 2) sorted 1..6: chunk metrics are the 2nd and 6th smallest = 2, 6.
    # Row 1: 8 entries (hanging 4) sorted 0.5, 1.5, 2.5, 3.5, 10..13: chunk metrics 3.5 and 13.
    # Row 2: 3 entries, the last two protected (+inf): its only chunk metric is the 3rd smallest = +inf.
    sorted_metric = torch.tensor(
        [
            [1, 2, 3, 4, 5, 6, INF, INF],
            [0.5, 1.5, 2.5, 3.5, 10, 11, 12, 13],
            [0.1, INF, INF, INF, INF, INF, INF, INF],
        ]
    )
    lengths = torch.tensor([6, 8, 3])
    expect = {1: [1, 0, 0], 2: [1, 1, 0], 3: [2, 1, 0], 4: [2, 2, 0], 10: [2, 2, 0]}
    for n, counts in expect.items():
        got = block_eviction_counts(sorted_metric, lengths, 4, n)
        assert got.tolist() == counts, n
    # evicting 1 block from row 0 removes its hanging 2 entries; 2 blocks remove 4 + 2
    assert evicted_entries(torch.tensor([1, 2, 0]), lengths, 4).tolist() == [2, 8, 0]
    assert evicted_entries(torch.tensor([2, 1, 0]), lengths, 4).tolist() == [6, 4, 0]


def test_ties_keep_each_heads_evictions_a_prefix():
    sorted_metric = torch.zeros(3, 12)  # every chunk ties
    counts = block_eviction_counts(sorted_metric, torch.tensor([12, 12, 12]), 4, 4)
    assert counts.tolist() == [2, 1, 1] or sorted(counts.tolist()) == [1, 1, 2]
    assert int(counts.sum()) == 4


def _filled_sequence(lengths: list[int], block_size=4, layers=2, heads=2, seed=0, pool=None):
    """A sequence whose rows hold ``lengths`` random entries (positions 0..n-1, random metric)."""
    g = torch.Generator().manual_seed(seed)
    pool = BlockPool(64, block_size, 3, torch.float32) if pool is None else pool
    seq = PagedSequence(pool, layers, heads)
    n_max = max(lengths)
    seq.seen = n_max
    need = [-(-n // block_size) for n in lengths]
    ids = pool.allocate(sum(need))
    at = 0
    for r, (n, k) in enumerate(zip(lengths, need, strict=True)):
        seq.set_row(r, ids[at : at + k], n)
        at += k
        slot, _ = seq.slots(torch.tensor([r]))
        s = slot[0, :n]
        pool.keys.view(-1, 3)[s] = torch.randn(n, 3, generator=g)
        pool.values.view(-1, 3)[s] = torch.randn(n, 3, generator=g)
        pool.positions.view(-1)[s] = torch.arange(n_max - n, n_max)
        pool.metric.view(-1)[s] = torch.rand(n, generator=g)
    return seq


def _entries(seq: PagedSequence, row: int) -> Counter:
    data = seq.gather()
    layer, head = divmod(row, seq.kv_heads)
    ok = data["valid"][layer, head]
    rows = zip(
        data["positions"][layer, head][ok].tolist(),
        map(tuple, data["keys"][layer, head][ok].tolist()),
        map(tuple, data["values"][layer, head][ok].tolist()),
        data["metric"][layer, head][ok].tolist(),
        strict=True,
    )
    return Counter(rows)


def test_eviction_frees_exactly_the_planned_blocks_and_keeps_survivors():
    seq = _filled_sequence([13, 7, 16, 4])
    pool = seq.pool
    before = [_entries(seq, r) for r in range(4)]
    free_before, held_before = pool.num_free, seq.blocks_held()
    plan = schedule_evictions(seq, blocks_to_evict=5, protected_window=2)
    assert plan.total_blocks == 5
    freed = apply_evictions(seq, plan)
    assert freed == 5 and pool.num_free == free_before + 5 and seq.blocks_held() == held_before - 5
    lengths = seq.row_lengths()
    for r in range(4):
        after = _entries(seq, r)
        # survivors: (position, K, V, metric) identical as a multiset, exactly the non-evicted ones
        assert sum(after.values()) == int(lengths[r]) == sum(before[r].values()) - len(plan.evicted[r])
        assert not (after - before[r])
        # the evicted entries are the lowest-metric ones of the row
        if len(plan.evicted[r]):
            gone = before[r] - after
            evictable = [m for (p, _, _, m) in after if p < seq.seen - 2]  # outside the protected window
            assert max(m for (_, _, _, m) in gone) <= min(evictable, default=INF)
        # contiguous: no hole before the length, all slots after it empty in the kept blocks
        slot, valid = seq.slots(torch.tensor([r]))
        own = len(seq.tables[r]) * pool.block_size  # beyond that the table is padding
        pos, valid = pool.positions.view(-1)[slot[0, :own]], valid[0, :own]
        assert bool((pos[valid] >= 0).all()) and bool((pos[~valid] == -1).all())


def test_protected_window_is_never_evicted():
    seq = _filled_sequence([13, 7, 16, 5], seed=1)
    seen = seq.seen
    held = [set(p for (p, _, _, _) in _entries(seq, r)) for r in range(4)]
    plan = schedule_evictions(seq, blocks_to_evict=100, protected_window=6)
    apply_evictions(seq, plan)
    data = seq.gather()
    for layer in range(2):
        for head in range(2):
            kept = set(data["positions"][layer, head][data["valid"][layer, head]].tolist())
            assert set(range(seen - 6, seen)) & held[layer * 2 + head] <= kept
            assert len(kept) < len(held[layer * 2 + head]) or len(kept) <= 6 + 3  # the rest went (block rounding)


def test_blocks_over_budget_and_compress_sequence():
    seq = _filled_sequence([13, 7, 16, 4])  # blocks 4 + 2 + 4 + 1 = 11
    assert blocks_over_budget(seq, max_cache_tokens=16) == 0  # 16 blocks allowed
    assert blocks_over_budget(seq, max_cache_tokens=5) == 11 - 5  # ceil(5*4/4) = 5 blocks allowed
    assert blocks_over_budget(seq, max_cache_tokens=3) == 11 - 3
    freed = compress_sequence(seq, max_cache_tokens=5, protected_window=1)
    assert freed == 6 and seq.blocks_held() == 5
    with pytest.raises(InvalidParameterError, match="max_cache_tokens"):
        blocks_over_budget(seq, max_cache_tokens=0)
    with pytest.raises(InvalidParameterError, match="protected_window"):
        schedule_evictions(seq, blocks_to_evict=1, protected_window=-1)


def test_random_rounds_keep_pool_consistent():
    g = torch.Generator().manual_seed(7)
    seq = _filled_sequence([16, 16, 16, 16], seed=2)
    pool = seq.pool
    for _ in range(5):
        plan = schedule_evictions(seq, blocks_to_evict=int(torch.randint(0, 4, (1,), generator=g)), protected_window=1)
        apply_evictions(seq, plan)
        assert pool.num_free + seq.blocks_held() == pool.num_blocks
        assert all(len(t) == -(-int(n) // 4) for t, n in zip(seq.tables, seq.row_lengths(), strict=True))
    seq.release()
    assert pool.num_free == pool.num_blocks


def _batch(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    pool = BlockPool(400, 4, 3, torch.float32)
    return [
        _filled_sequence(torch.randint(1, 40, (6,), generator=g).tolist(), layers=2, heads=3, seed=seed + i, pool=pool)
        for i in range(5)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compress_sequences_in_one_batch_equals_one_by_one(seed):
    budgets, window = [3, 9, 30, 1, 5], 4
    alone, batched = _batch(seed), _batch(seed)
    freed_alone = [
        compress_sequence(s, max_cache_tokens=m, protected_window=window)
        for s, m in zip(alone, budgets, strict=True)
    ]
    freed = compress_sequences(batched, max_cache_tokens=budgets, protected_window=window)
    assert freed == freed_alone and sum(freed) > 0 and 0 in freed  # the 30-token budget keeps its sequence whole
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a.row_lengths(), b.row_lengths()) and a.blocks_held() == b.blocks_held()
        ga, gb = a.gather(), b.gather()
        for key in ("keys", "values", "positions", "metric", "valid"):
            assert torch.equal(ga[key], gb[key]), key
    pool = batched[0].pool
    assert pool.num_used == sum(s.blocks_held() for s in batched)
    for s in batched:
        s.release()
    assert pool.num_free == pool.num_blocks


def test_compress_sequences_matches_the_schedule_and_apply_pair():
    seq, ref = _filled_sequence([13, 7, 16, 4], seed=3), _filled_sequence([13, 7, 16, 4], seed=3)
    over = blocks_over_budget(ref, max_cache_tokens=4)
    apply_evictions(ref, schedule_evictions(ref, blocks_to_evict=over, protected_window=2))
    assert compress_sequences([seq], max_cache_tokens=[4], protected_window=2) == [over]
    assert torch.equal(seq.gather()["positions"], ref.gather()["positions"])
    with pytest.raises(InvalidParameterError, match="max_cache_tokens"):
        compress_sequences([seq], max_cache_tokens=[0], protected_window=2)
    with pytest.raises(InvalidParameterError, match="max_cache_tokens"):
        compress_sequences([seq], max_cache_tokens=[4, 4], protected_window=2)
    other = PagedSequence(BlockPool(8, 4, 3, torch.float32), 2, 2)
    with pytest.raises(InvalidParameterError, match="share one pool"):
        compress_sequences([seq, other], max_cache_tokens=[4, 4], protected_window=2)
