"""Scorers checked against transformers' own eager attention weights."""

from __future__ import annotations

import torch

from conftest import tiny_model
from kvtrim.budgets.uniform import UniformBudget
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.compression.pipeline import Pipeline
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.scoring.base import LayerView
from kvtrim.scoring.cumulative_attention import CumulativeAttentionScorer
from kvtrim.scoring.key_norm import KeyNormScorer
from kvtrim.scoring.reduce import pool_sequence, reduce_group
from kvtrim.scoring.window_attention import WindowAttentionScorer
from kvtrim.selection.topk import TopKSelector


def eager_attentions(model, ids):
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = model(input_ids=ids, output_attentions=True)
    model.set_attn_implementation("sdpa")
    return out.attentions  # per layer [batch, q_heads, seq, seq]


def prefill(model, ids, scorer):
    pipe = Pipeline("test", scorer, UniformBudget(), TopKSelector())
    cache = KVTrimCache(model.config.num_hidden_layers, pipe, BudgetSpec(budget=1), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def view_of(cache, layer):
    lay = cache.layers[layer]
    return LayerView(
        layer,
        len(cache.layers),
        lay.store.keys,
        lay.store.values,
        lay.store.positions,
        torch.tensor([lay.seen]),
        lay.observation,
        {n: lay.store.stat(n) for n in cache.observation_spec.accumulate},
        lay.module,
        lay.module.scaling,
    )


def test_cumulative_attention_equals_eager_column_sums():
    model = tiny_model("llama", layers=2, heads=8, kv_heads=2)
    ids = torch.randint(3, 200, (1, 70), generator=torch.Generator().manual_seed(0))
    attn = eager_attentions(model, ids)
    cache = prefill(model, ids, CumulativeAttentionScorer(chunk=16))  # several query chunks
    for layer in range(2):
        ours = CumulativeAttentionScorer().score(view_of(cache, layer))
        ref = attn[layer].sum(dim=2).view(1, 2, 4, 70).sum(2)  # sum over queries, then over the group
        assert torch.allclose(ours, ref, atol=1e-4)


def test_window_attention_scorer_equals_eager_window_rows():
    model = tiny_model("qwen2", layers=2, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (1, 50), generator=torch.Generator().manual_seed(1))
    attn = eager_attentions(model, ids)
    scorer = WindowAttentionScorer(window=8, kernel=5, pooling="avg", group_reduce="mean")
    cache = prefill(model, ids, scorer)
    for layer in range(2):
        ours = scorer.score(view_of(cache, layer))
        window_rows = attn[layer][:, :, -8:, :].mean(2)  # [1, q_heads, seq]
        ref = pool_sequence(reduce_group(window_rows, 2, "mean"), 5, "avg")
        assert torch.allclose(ours, ref, atol=1e-5)


def test_key_norm_scores_lowest_norm_highest():
    model = tiny_model("llama", layers=1)
    ids = torch.randint(3, 200, (1, 20))
    cache = prefill(model, ids, KeyNormScorer())
    view = view_of(cache, 0)
    scores = KeyNormScorer().score(view)
    assert torch.allclose(scores, -view.keys.norm(dim=-1))
