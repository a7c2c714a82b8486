"""One-head sub-pages of a request's blocks: allocation, capacity bound and invariants (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtrim.vllm.subpages import RequestSubPages, SubPageError, slots_for_head_budget


def test_slots_for_head_budget_is_budget_plus_block_minus_one_or_the_prompt():
    assert slots_for_head_budget(128, 1024, 32) == 159
    assert slots_for_head_budget(128, 140, 32) == 140
    assert slots_for_head_budget(0, 50, 16) == 15


def test_place_and_append_give_each_head_its_own_pages_in_block_order():
    pages = RequestSubPages(num_layers=2, kv_heads=3, block_size=4, blocks=[7, 2])
    slots = pages.place(0, np.array([5, 0, 1]))
    # sub-pages of block 7 are 21, 22, 23, of block 2: 6, 7, 8; handed out in block order
    assert pages.table(0) == [[21, 22], [], [23]]
    assert slots[0].tolist() == [84, 85, 86, 87, 88]
    assert slots[1].tolist() == [] and slots[2].tolist() == [92]
    new = pages.append(0, 4)  # head 0: 3 more in page 22 then page 6; head 1: page 7; head 2: rest of page 23
    assert new[:, 0].tolist() == [89, 90, 91, 24]
    assert new[:, 1].tolist() == [28, 29, 30, 31]
    assert new[:, 2].tolist() == [93, 94, 95, 32]
    assert pages.lengths[0].tolist() == [9, 4, 5]
    assert pages.lengths[1].tolist() == [0, 0, 0]  # layer 1 has its own pages and lengths
    pages.check()
    with pytest.raises(SubPageError, match="already holds"):
        pages.place(0, np.array([1, 1, 1]))


@pytest.mark.parametrize("seed", range(20))
def test_per_head_counts_with_the_mean_budget_always_fit_the_uniform_slot_count(seed):
    """Σ_h k_h = H·B fits in the blocks of slots_for_head_budget(B) + t tokens, for any split and any t."""
    rng = np.random.default_rng(seed)
    heads, bs = int(rng.integers(1, 9)), int(rng.choice([4, 16, 32]))
    prompt = int(rng.integers(2, 300))
    budget = int(rng.integers(1, prompt))
    counts = rng.multinomial(heads * budget, np.ones(heads) / heads)
    counts = np.minimum(counts, prompt)  # a head keeps at most the prompt (capped splits keep less in total)
    slots = slots_for_head_budget(budget, prompt, bs)
    next_block = iter(range(1000, 5000))
    held = -(-slots // bs)
    pages = RequestSubPages(1, heads, bs, [next(next_block) for _ in range(held)])
    pages.place(0, counts)
    for t in range(1, 3 * bs):
        need = -(-(slots + t) // bs)  # what vLLM's scheduler allocates for slots + t tokens
        pages.add_blocks([next(next_block) for _ in range(need - len(pages.blocks))])
        pages.append(0, 1)
        pages.check()
    assert pages.lengths[0].tolist() == (counts + 3 * bs - 1).tolist()


def test_a_split_over_the_bound_is_refused_and_block_lists_must_only_grow():
    pages = RequestSubPages(1, 2, 4, [1])
    with pytest.raises(SubPageError, match="needs 3 more sub-pages for 9 entries, the request has 2 free"):
        pages.place(0, np.array([9, 0]))
    pages = RequestSubPages(1, 2, 4, [1, 3])
    pages.sync_blocks([1, 3, 5])
    assert pages.blocks == [1, 3, 5]
    with pytest.raises(SubPageError, match="no longer starts"):
        pages.sync_blocks([3, 5])


def test_a_round_restarts_each_layer_on_the_first_blocks_and_gives_up_the_rest():
    pages = RequestSubPages(num_layers=2, kv_heads=2, block_size=4, blocks=[7, 2])
    for layer in range(2):
        pages.place(layer, np.array([3, 2]))
    pages.sync_blocks([7, 2, 5])  # a chunk's block
    pages.append(0, 4)
    pages.append(1, 4)
    assert pages.slots(0, 0).tolist() == [56, 57, 58, 59, 16, 17, 18]  # pages 14 then 4 (blocks 7 and 2)
    with pytest.raises(SubPageError, match="past the first 2"):
        pages.truncate_blocks(2)  # layer 0 still holds sub-pages of block 5
    for layer in range(2):
        pages.restart_layer(layer, 2)
        assert pages.lengths[layer].tolist() == [0, 0] and pages.table(layer) == [[], []]
        pages.place(layer, np.array([5, 3]))  # 2 + 1 of the 4 sub-pages of blocks 7 and 2
    pages.truncate_blocks(2)
    assert pages.blocks == [7, 2] and pages.table(0) == [[14, 15], [4]] and pages.free[0] == [5]
    pages.check()
    with pytest.raises(SubPageError, match="cannot restart layer 0 on 3"):
        pages.restart_layer(0, 3)


@pytest.mark.parametrize("seed", range(10))
def test_append_all_equals_appending_layer_by_layer(seed):
    """One pass over every layer gives the slots, pages and lengths that per-layer appends give."""
    rng = np.random.default_rng(seed)
    layers, heads, bs = int(rng.integers(1, 5)), int(rng.integers(1, 5)), int(rng.choice([2, 4, 16]))
    blocks = [int(b) for b in rng.permutation(200)[:6]]
    a, b = (RequestSubPages(layers, heads, bs, blocks[:3]) for _ in range(2))
    for layer in range(layers):
        counts = rng.integers(0, 2 * bs, heads)
        a.place(layer, counts)
        b.place(layer, counts)
    for step, n in enumerate(rng.integers(1, bs + 2, 4)):
        if step == 2:
            a.sync_blocks(blocks)
            b.sync_blocks(blocks)
        try:
            expected = np.stack([a.append(layer, int(n)) for layer in range(layers)])
        except SubPageError:
            with pytest.raises(SubPageError, match="more sub-pages"):
                b.append_all(int(n))
            break
        assert np.array_equal(b.append_all(int(n)), expected)
        assert np.array_equal(a.lengths, b.lengths)
        assert all(a.table(layer) == b.table(layer) for layer in range(layers))
        b.check()


def test_append_all_refuses_before_changing_anything():
    pages = RequestSubPages(2, 2, 4, [1])
    pages.place(0, np.array([2, 2]))
    pages.place(1, np.array([4, 0]))
    before = (pages.lengths.copy(), [pages.table(layer) for layer in range(2)], [list(f) for f in pages.free])
    with pytest.raises(SubPageError, match="layer 1 needs 2 more sub-pages for 1 entries per head"):
        pages.append_all(1)  # layer 1: head 0's page is full and head 1 has none, no sub-page is free
    assert np.array_equal(pages.lengths, before[0])
    assert [pages.table(layer) for layer in range(2)] == before[1] and pages.free == before[2]
