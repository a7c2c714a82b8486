"""Head-subset window attention (CompressKV's SRH scorer)."""

from __future__ import annotations

import torch

from conftest import tiny_model
from kvtrim.budgets.uniform import UniformBudget
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.compression.pipeline import Pipeline
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.scoring.head_subset import HeadSubsetScorer, top_heads_per_layer
from kvtrim.scoring.reduce import pool_sequence
from kvtrim.selection.topk import TopKSelector


def _prefill(model, scorer, budget, n=64, seed=0, compress=True):
    pipeline = Pipeline("t", scorer, UniformBudget(), TopKSelector(recent=scorer.window))
    cache = KVTrimCache(model.config.num_hidden_layers, pipeline, BudgetSpec(budget=budget), auto_compress=False)
    ids = torch.randint(3, 200, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        if compress:
            cache.compress()
    return cache


def test_top_heads_per_layer():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.5], [1.0, 0.0, 0.2, 0.3]])
    assert top_heads_per_layer(scores, 2).tolist() == [[1, 2], [0, 3]]


def test_same_indices_for_every_kv_head_of_a_layer():
    model = tiny_model("llama", layers=2, heads=8, kv_heads=4)
    heads = torch.tensor([[0, 3, 5, 6], [1, 2, 7, 4]])
    cache = _prefill(model, HeadSubsetScorer(heads), budget=24)
    for layer in cache.layers:
        pos = layer.store.positions[0]
        assert pos.shape == (4, 24)
        assert bool((pos == pos[:1]).all())  # every KV head keeps the same tokens
        assert set(range(64 - 8, 64)) <= set(pos[0].tolist())  # the window is protected


def test_scores_match_a_direct_computation():
    model = tiny_model("qwen2", layers=1, heads=4, kv_heads=2)
    heads = torch.tensor([[3, 0]])
    scorer = HeadSubsetScorer(heads, window=8, kernel=5)
    cache = _prefill(model, scorer, budget=20, n=40, compress=False)
    layer = cache.layers[0]
    from kvtrim.scoring.base import LayerView

    view = LayerView(
        layer_idx=0,
        num_layers=1,
        keys=layer.store.keys,
        values=layer.store.values,
        positions=layer.store.positions,
        context_lengths=torch.tensor([40]),
        observation=layer.observation,
        stats={},
        module=layer.module,
        scaling=float(layer.module.scaling),
    )
    got = scorer.score(view)  # [1, 2, 40]
    # direct: per chosen head, softmax(q k^T) of its KV group, summed over the 8 window queries, window zeroed
    q = layer.observation.queries[0]  # [4, 8, d]
    k = layer.store.keys[0]  # [2, 40, d]
    rows = []
    for h in (3, 0):
        logits = q[h] @ k[h // 2].T * view.scaling  # [8, 40]
        qpos = torch.arange(32, 40).view(8, 1)
        logits = logits.masked_fill(torch.arange(40).view(1, 40) > qpos, float("-inf"))
        a = torch.softmax(logits.float(), -1).sum(0)
        a[32:] = 0
        rows.append(pool_sequence(a.view(1, 1, 40), 5, "avg").view(40))
    expected = torch.stack(rows).mean(0)
    torch.testing.assert_close(got[0, 0], expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[0, 1], expected, atol=1e-5, rtol=1e-4)


def test_per_kv_head_mode_differs_between_groups():
    model = tiny_model("llama", layers=1, heads=4, kv_heads=2)
    scorer = HeadSubsetScorer(torch.tensor([[0, 3]]), per_kv_head=True)
    cache = _prefill(model, scorer, budget=40, n=64, compress=False)
    layer = cache.layers[0]
    from kvtrim.scoring.base import LayerView

    view = LayerView(
        0,
        1,
        layer.store.keys,
        layer.store.values,
        layer.store.positions,
        torch.tensor([64]),
        layer.observation,
        {},
        layer.module,
        float(layer.module.scaling),
    )
    per_kv = scorer.score(view)
    shared = HeadSubsetScorer(torch.tensor([[0, 3]])).score(view)
    assert not torch.allclose(per_kv[0, 0], per_kv[0, 1])
    torch.testing.assert_close((per_kv[0, 0] + per_kv[0, 1]) / 2, shared[0, 0])
