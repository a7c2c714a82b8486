"""Global block budgets (KV-Compress) and their agreement with the paged eviction path."""

from __future__ import annotations

import pytest
import torch

from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.global_blocks import GlobalBlockBudget
from kvtrim.cache.paged import BlockPool, PagedSequence
from kvtrim.errors import InvalidParameterError
from kvtrim.selection.block_eviction import apply_evictions, blocks_over_budget, schedule_evictions

torch.set_num_threads(1)


def _request(scores, positions, keep, context):
    return BudgetRequest(
        keep=torch.tensor([keep]),
        context_lengths=torch.tensor([context]),
        num_layers=len(scores),
        kv_heads=scores[0].shape[1],
        positions=positions,
    )


def test_counts_respect_block_budget_and_vary_per_head():
    g = torch.Generator().manual_seed(0)
    layers, heads, n, bs = 3, 2, 64, 16
    scores = [torch.rand(1, heads, n, generator=g) * (i + 1) ** 3 for i in range(layers)]
    positions = [torch.arange(n).expand(1, heads, n).clone() for _ in range(layers)]
    budget = GlobalBlockBudget(block_size=bs, protected_window=8)
    counts = budget.allocate(_request(scores, positions, 20, n), scores)
    blocks = (-(-counts // bs)).sum()
    assert int(blocks) == -(-20 * layers * heads // bs)  # ceil(M·L·H / bs) blocks remain
    assert len(set(counts.flatten().tolist())) > 1
    assert bool((counts >= 8).all())  # the protected window stays
    assert int(counts[0, -1].sum()) > int(counts[0, 0].sum())  # the higher-scored layer keeps more


def test_pipeline_budget_equals_paged_eviction_on_the_same_metric():
    g = torch.Generator().manual_seed(1)
    layers, heads, n, bs = 2, 2, 37, 4
    pool = BlockPool(64, bs, 2, torch.float32)
    seq = PagedSequence(pool, layers, heads)
    seq.reserve(n)
    seq.store.add_length(torch.tensor([seq.slot]), n)  # n entries per row, written below
    seq.seen = n
    slot, _ = seq.slots()
    metric = torch.rand(layers * heads, n, generator=g)
    pool.metric.view(-1)[slot[:, :n]] = metric
    pool.positions.view(-1)[slot[:, :n]] = torch.arange(n)
    budget = GlobalBlockBudget(block_size=bs, protected_window=5)
    scores = [metric.view(layers, heads, n)[i][None] for i in range(layers)]
    positions = [torch.arange(n).expand(1, heads, n).clone() for _ in range(layers)]
    counts = budget.allocate(_request(scores, positions, 9, n), scores)[0]
    plan = schedule_evictions(seq, blocks_to_evict=blocks_over_budget(seq, max_cache_tokens=9), protected_window=5)
    apply_evictions(seq, plan)
    assert torch.equal(seq.lengths(), counts)


def test_budget_at_or_above_context_keeps_everything_and_errors():
    scores = [torch.rand(1, 2, 10)]
    positions = [torch.arange(10).expand(1, 2, 10).clone()]
    counts = GlobalBlockBudget(block_size=4, protected_window=2).allocate(_request(scores, positions, 10, 10), scores)
    assert bool((counts == 10).all())
    with pytest.raises(InvalidParameterError, match="block_size"):
        GlobalBlockBudget(block_size=0)
    with pytest.raises(InvalidParameterError, match="protected_window"):
        GlobalBlockBudget(protected_window=-1)


@pytest.mark.parametrize("method", ["kvcompress", "kvc_w8", "kvc_full", "kvcompress@every:16"])
def test_registry_methods_run_through_the_api(method):
    import kvtrim
    from conftest import byte_tokenizer, random_text, tiny_model

    model = tiny_model("llama", layers=2)
    result = kvtrim.generate(
        model, byte_tokenizer(), random_text(200), "q?", method=method, ratio=0.5, max_new_tokens=40
    )
    stats = result.stats
    target = -(-100 * 2 * 2 // 16) * 16  # ceil(M·L·H / 16) blocks of entries at most
    assert stats.kv_entries_after <= target < stats.kv_entries_before
    if "@every" in method:
        assert stats.compressions > 1


def _layered_scores(layers: int, heads: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    head_scale = (torch.arange(heads, dtype=torch.float32) + 1).pow(2).view(1, heads, 1)  # heads differ, as layers
    scores = [torch.rand(1, heads, n, generator=g) * head_scale * (i + 1) ** 3 for i in range(layers)]
    positions = [torch.arange(n).expand(1, heads, n).clone() for _ in range(layers)]
    return scores, positions


def test_even_layers_hold_the_same_blocks_per_layer_while_heads_differ():
    layers, heads, n, bs, keep = 3, 3, 100, 16, 30
    scores, positions = _layered_scores(layers, heads, n, 2)
    budget = GlobalBlockBudget(block_size=bs, protected_window=8, even_layers=True)
    counts = budget.allocate(_request(scores, positions, keep, n), scores)[0]  # [layers, heads]
    blocks = (-(-counts // bs)).sum(-1)
    assert blocks.tolist() == [-(-keep * heads // bs)] * layers  # ⌈M·H/bs⌉ = 6 blocks in every layer
    assert all(len(set(row.tolist())) > 1 for row in counts)  # heads within each layer keep different counts
    assert bool((counts.sum(-1) <= budget.layer_bound(keep, heads, n)).all())
    assert bool((counts >= 8).all())  # the protected window stays
    for layer in range(layers):  # one grouped ranking equals ranking each layer alone
        alone = budget.head_counts(scores[layer][0], positions[layer][0], keep, n)
        assert torch.equal(counts[layer], alone)
    across = GlobalBlockBudget(block_size=bs, protected_window=8).allocate(_request(scores, positions, keep, n), scores)
    held = (-(-across[0] // bs)).sum(-1)
    assert len(set(held.tolist())) > 1 and int(held.sum()) == -(-keep * layers * heads // bs)  # layers differ


def test_even_layers_keep_everything_at_or_above_the_context():
    scores, positions = _layered_scores(2, 3, 40, 3)
    budget = GlobalBlockBudget(block_size=16, protected_window=8, even_layers=True)
    for keep in (40, 64):
        counts = budget.allocate(_request(scores, positions, keep, 40), scores)
        assert bool((counts == 40).all())
        assert budget.layer_bound(keep, 3, 40) == 3 * 40


def test_layer_bound_covers_the_protected_window():
    budget = GlobalBlockBudget(block_size=16, protected_window=32, even_layers=True)
    assert budget.layer_bound(64, 3, 700) == 192  # ⌈64·3/16⌉ blocks of 16
    assert budget.layer_bound(50, 3, 700) == 160  # ⌈150/16⌉ = 10 blocks
    assert budget.layer_bound(8, 3, 700) == 96  # a head keeps ≥ 32 protected entries: 3·32 > ⌈24/16⌉·16
    small = GlobalBlockBudget(block_size=16, protected_window=8, even_layers=True)
    assert small.layer_bound(8, 3, 700) == 48  # a head that evicts keeps whole blocks: ≥ 16 entries each
    scores, positions = _layered_scores(2, 3, 200, 4)
    for b, keep in ((budget, 8), (small, 8), (small, 20)):
        counts = b.allocate(_request(scores, positions, keep, 200), scores)[0]
        assert int(counts.sum(-1).max()) <= b.layer_bound(keep, 3, 200)
        assert int(counts.sum(-1).max()) == b.layer_bound(keep, 3, 200) or keep == 20


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_even_layer_flag_must_be_a_bool(flag):
    with pytest.raises(InvalidParameterError, match="even_layer_evict"):
        GlobalBlockBudget(even_layers=flag)
    from kvtrim.methods import get_method

    with pytest.raises(InvalidParameterError, match="even_layer_evict"):
        get_method("kvc_w8", even_layer_evict=flag)


@pytest.mark.parametrize("method", ["kvcompress", "kvc_w8", "kvc_full"])
def test_even_layer_evict_reaches_the_budget_and_the_vllm_capability(method):
    from kvtrim.methods import get_method, method_info
    from kvtrim.methods.registry import capabilities_of

    pipeline = get_method(method, even_layer_evict=True)
    assert pipeline.budget.even_layers and pipeline.params["even_layer_evict"] is True
    assert capabilities_of(pipeline).vllm and not method_info(method).capabilities.vllm  # default: across layers
    assert not get_method(method).budget.even_layers


def test_even_layer_evict_through_the_cache_keeps_the_same_blocks_per_layer():
    import kvtrim
    from conftest import tiny_model
    from kvtrim.methods import get_method

    model = tiny_model("llama", layers=3)
    ids = torch.randint(3, 200, (1, 120), generator=torch.Generator().manual_seed(5))
    cache = kvtrim.make_cache(model, "kvcompress", budget=40, even_layer_evict=True)
    model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, past_key_values=cache, pad_token_id=0)
    counts = cache.last_report.budgets[0]  # [layers, kv_heads]
    heads = counts.shape[-1]
    blocks = (-(-counts // 16)).sum(-1)
    assert blocks.tolist() == [-(-40 * heads // 16)] * 3
    bound = get_method("kvcompress", even_layer_evict=True).budget.layer_bound(40, heads, 120)
    assert int(counts.sum(-1).max()) <= bound
    assert any(len(set(row.tolist())) > 1 for row in counts) or heads == 1


def test_layer_pages_count_the_chunks_a_layer_keeps():
    budget = GlobalBlockBudget(block_size=32, protected_window=32, even_layers=True)
    assert budget.layer_pages(128, 3, 1024) == 12  # ⌈128·3/32⌉
    assert budget.layer_pages(50, 3, 700) == 6  # every head at or under 50 keeps ⌈50/32⌉ = 2 pages: 3·2 > ⌈150/32⌉
    assert budget.layer_pages(8, 3, 700) == 3  # the protected window: one page per head
    assert budget.layer_pages(128, 3, 100) == 12  # nothing evicted: every head's 100 entries in 4 pages
    for keep, length in ((128, 1024), (50, 700), (8, 700)):  # never under the entries' bound in whole pages
        assert budget.layer_pages(keep, 3, length) * 32 >= budget.layer_bound(keep, 3, length)


@pytest.mark.parametrize("even_layers", [True, False])
def test_head_groups_rank_each_group_of_heads_alone(even_layers):
    """head_groups=2: the counts are those of each half of the heads (every layer's) ranked on its own, each half
    down to its own heads' blocks."""
    layers, heads, n, bs, keep = 3, 4, 100, 16, 30
    scores, positions = _layered_scores(layers, heads, n, 5)
    grouped = GlobalBlockBudget(block_size=bs, protected_window=8, even_layers=even_layers, head_groups=2)
    alone = GlobalBlockBudget(block_size=bs, protected_window=8, even_layers=even_layers)
    counts = grouped.allocate(_request(scores, positions, keep, n), scores)[0]  # [layers, heads]
    for half in (slice(0, 2), slice(2, 4)):
        part_scores = [s[:, half] for s in scores]
        part_positions = [p[:, half] for p in positions]
        expected = alone.allocate(_request(part_scores, part_positions, keep, n), part_scores)[0]
        assert torch.equal(counts[:, half], expected)
        blocks = (-(-counts[:, half] // bs)).sum(-1)
        if even_layers:  # every layer's half keeps ⌈M·H/2/bs⌉ blocks
            assert blocks.tolist() == [-(-keep * 2 // bs)] * layers
        else:
            assert int(blocks.sum()) == -(-keep * layers * 2 // bs)
    assert len(set(counts.flatten().tolist())) > 1
    assert grouped.layer_bound(keep, heads, n) == 2 * alone.layer_bound(keep, 2, n)
    assert grouped.layer_pages(keep, heads, n) == 2 * alone.layer_pages(keep, 2, n)
    if even_layers:
        assert bool((counts.sum(-1) <= grouped.layer_bound(keep, heads, n)).all())


def test_head_groups_must_divide_the_heads():
    scores, positions = _layered_scores(2, 3, 40, 3)
    with pytest.raises(InvalidParameterError, match="head_groups must be an integer >= 1"):
        GlobalBlockBudget(head_groups=0)
    with pytest.raises(InvalidParameterError, match="head_groups=2 must divide the layer's 3 KV heads"):
        GlobalBlockBudget(head_groups=2).allocate(_request(scores, positions, 20, 40), scores)
