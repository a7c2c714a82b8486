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
