"""AdaKV head-adaptive budgets."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.budgets.head_adaptive import HeadAdaptiveBudget, largest_remainder


def test_largest_remainder_is_exact():
    out = largest_remainder(torch.tensor([1.0, 1.0, 1.0]), 10)
    assert int(out.sum()) == 10 and sorted(out.tolist()) == [3, 3, 4]


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 6),
    seq=st.integers(20, 80),
    keep=st.integers(9, 40),
    seed=st.integers(0, 999),
    rule=st.sampled_from(["official", "kvpress"]),
)
def test_budgets_sum_to_layer_budget_and_respect_floor(heads, seq, keep, seed, rule):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(heads, seq, generator=g) ** 4  # skewed so heads differ
    positions = torch.arange(seq).expand(heads, seq)
    alloc = HeadAdaptiveBudget(alpha=0.2, window=8, rule=rule)
    keep = min(keep, seq)
    budgets = alloc.head_budgets(scores, positions, keep, seq)
    assert int(budgets.sum()) == heads * keep  # the layer total is exactly the uniform total
    per_head = keep - 8
    floor = int(0.2 * per_head) if rule == "official" else max(0, int(0.2 * keep) - 8)
    if per_head > 0:
        assert bool((budgets - 8 >= floor).all())  # the safeguard floor
    assert bool((budgets <= seq).all())


def test_skewed_heads_get_more():
    scores = torch.stack([torch.linspace(1, 0, 100), torch.full((100,), 0.001)])
    scores[0, :50] = 10.0
    budgets = HeadAdaptiveBudget(alpha=0.2, window=8).head_budgets(scores, torch.arange(100).expand(2, 100), 40, 100)
    assert budgets[0] > budgets[1] and int(budgets.sum()) == 80
    assert int(budgets[1]) - 8 >= int(0.2 * 32)


@settings(max_examples=80, deadline=None)
@given(
    heads=st.integers(1, 6),
    seq=st.integers(20, 300),
    keep=st.integers(1, 120),
    page=st.sampled_from([4, 16, 32]),
    seed=st.integers(0, 999),
    ragged=st.booleans(),
)
def test_whole_pages_fill_the_uniform_pages_and_stay_near_adakvs_counts(heads, seq, keep, page, seed, ragged):
    """page_size: counts are whole pages or a head's whole row, the layer holds at most layer_pages pages (the
    uniform budget's ⌈H·keep/P⌉ when heads are longer), each head keeps its window and moves less than a page."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(heads, seq, generator=g) ** 4
    lengths = torch.randint(1, seq + 1, (heads,), generator=g) if ragged else torch.full((heads,), seq)
    positions = torch.full((heads, seq), -1)
    for h, n in enumerate(lengths.tolist()):
        positions[h, :n] = torch.arange(seq - n, seq)
    keep = min(keep, seq)
    plain = HeadAdaptiveBudget(alpha=0.2, window=8).head_budgets(scores.clone(), positions, keep, seq)
    paged = HeadAdaptiveBudget(alpha=0.2, window=8, page_size=page)
    counts = paged.head_budgets(scores.clone(), positions, keep, seq)
    if keep <= 8:  # a budget within the window: every head keeps the budget, as AdaKV
        assert torch.equal(counts, plain)
        return
    assert bool((counts <= lengths).all())
    assert bool(((counts % page == 0) | (counts == lengths)).all())  # whole pages, or the whole row
    pages = -(-counts // page)
    assert int(pages.sum()) <= paged.layer_pages(keep, heads, int(lengths.max()))
    assert bool((counts >= torch.minimum(lengths, torch.tensor(8))).all())  # the window stays
    if not ragged and seq > keep:
        # the uniform budget's pages, all used (at least each head's window page, at most the rows' pages)
        expected = min(max(-(-heads * keep // page), heads * -(-8 // page)), heads * -(-seq // page))
        assert int(pages.sum()) == expected
        assert bool(((counts - plain).abs() < page).all())  # each head within a page of AdaKV's count


def test_page_size_one_is_adakv_and_bad_page_sizes_are_refused():
    import pytest

    from kvtrim.errors import InvalidParameterError

    g = torch.Generator().manual_seed(0)
    scores, positions = torch.rand(3, 200, generator=g) ** 4, torch.arange(200).expand(3, 200)
    scores[0] *= 20  # a sharper head wins more of the layer's budget
    assert torch.equal(
        HeadAdaptiveBudget(page_size=1).head_budgets(scores, positions, 64, 200),
        HeadAdaptiveBudget().head_budgets(scores, positions, 64, 200),
    )
    counts = HeadAdaptiveBudget(page_size=32).head_budgets(scores, positions, 64, 200)
    assert int(counts.sum()) == 192 and bool((counts % 32 == 0).all()) and len(set(counts.tolist())) > 1
    for bad in (0, -4, 2.5, True):
        with pytest.raises(InvalidParameterError, match="page_size must be an integer >= 1"):
            HeadAdaptiveBudget(page_size=bad)


@settings(max_examples=40, deadline=None)
@given(
    groups=st.sampled_from([1, 2, 3]),
    per_group=st.integers(1, 3),
    seq=st.integers(20, 200),
    keep=st.integers(1, 100),
    page=st.sampled_from([1, 16]),
    seed=st.integers(0, 999),
)
def test_head_groups_split_each_group_alone(groups, per_group, seq, keep, page, seed):
    """head_groups=G: the counts are those of each group of H/G consecutive heads allocated on its own (its share
    ``(H/G)·keep``), and the layer's pages are the groups' pages."""
    heads = groups * per_group
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(heads, seq, generator=g) ** 4 * torch.rand(heads, 1, generator=g) * 10
    positions = torch.arange(seq).expand(heads, seq)
    keep = min(keep, seq)
    grouped = HeadAdaptiveBudget(page_size=page, head_groups=groups)
    alone = HeadAdaptiveBudget(page_size=page)
    counts = grouped.head_budgets(scores, positions, keep, seq)
    parts = zip(scores.chunk(groups), positions.chunk(groups), strict=True)
    expected = torch.cat([alone.head_budgets(s, p, keep, seq) for s, p in parts])
    assert torch.equal(counts, expected)
    assert grouped.layer_pages(keep, heads, seq) == groups * alone.layer_pages(keep, per_group, seq)
    if page == 1 and seq > keep:  # each group keeps exactly its share
        assert counts.view(groups, per_group).sum(-1).tolist() == [per_group * keep] * groups


def test_one_head_per_group_is_the_uniform_count_and_bad_groups_are_refused():
    import pytest

    from kvtrim.errors import InvalidParameterError

    g = torch.Generator().manual_seed(1)
    scores, positions = torch.rand(4, 120, generator=g) ** 4, torch.arange(120).expand(4, 120)
    scores[0] *= 50
    assert len(set(HeadAdaptiveBudget().head_budgets(scores, positions, 40, 120).tolist())) > 1
    assert HeadAdaptiveBudget(head_groups=4).head_budgets(scores, positions, 40, 120).tolist() == [40] * 4
    two = HeadAdaptiveBudget(head_groups=2).head_budgets(scores, positions, 40, 120)
    assert int(two[:2].sum()) == int(two[2:].sum()) == 80 and int(two[0]) > int(two[1])  # head 0 wins its group
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidParameterError, match="head_groups must be an integer >= 1"):
            HeadAdaptiveBudget(head_groups=bad)
    with pytest.raises(InvalidParameterError, match="head_groups=3 must divide the layer's 4 KV heads"):
        HeadAdaptiveBudget(head_groups=3).head_budgets(scores, positions, 40, 120)
