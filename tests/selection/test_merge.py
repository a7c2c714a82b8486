"""Merge on evict (kvpress MergingPress, after D2O, arXiv 2406.13035): evicted values fold into kept entries."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.compression.compressor import BudgetSpec, layer_views
from kvtrim.errors import InvalidParameterError
from kvtrim.methods import get_method
from kvtrim.selection.merge import NearestKeyMerge, merge_evicted_values

# Slots 0, 1 kept (keys e1, e2); slot 2 evicted with key e1 (cosine 1 with slot 0), slot 3 evicted with key
# (0.6, 0.8) (cosine 0.6 with slot 0, 0.8 with slot 1).
KEYS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.6, 0.8]])[None, None]
VALUES = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 1.0]])[None, None]
KEPT = torch.tensor([[[True, True, False, False]]])


def _merged(**params):
    return merge_evicted_values(KEYS, VALUES, ~KEPT, KEPT, **params)[0, 0]


def test_an_evicted_value_joins_its_nearest_kept_entry_weighted_by_similarity_and_norm():
    out = _merged()
    # slot 2 -> slot 0: w = 1 · 3 / (3 + 1) = 0.75; slot 3 -> slot 1: w = 0.8 · 1 / (1 + 1) = 0.4
    assert torch.allclose(out[0], torch.tensor([1.0, 0.0, 2.25]) / 1.75)
    assert torch.allclose(out[1], torch.tensor([0.0, 1.0, 0.4]) / 1.4)
    assert torch.equal(out[2:], VALUES[0, 0, 2:])  # evicted slots are left as they were (they are dropped next)


def test_the_threshold_and_the_fraction_limit_the_merges():
    out = _merged(threshold=0.9)  # only slot 2 (cosine 1) merges
    assert torch.allclose(out[0], torch.tensor([1.0, 0.0, 2.25]) / 1.75) and torch.equal(out[1], VALUES[0, 0, 1])
    assert torch.equal(_merged(fraction=0.5), out)  # the more similar half of the two merges: slot 2 again


def test_nothing_changes_without_evictions_or_similar_keys():
    assert torch.equal(merge_evicted_values(KEYS, VALUES, torch.zeros_like(KEPT), KEPT)[0, 0], VALUES[0, 0])
    opposite = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]])[None, None]
    assert torch.equal(merge_evicted_values(opposite, VALUES, ~KEPT, KEPT)[0, 0], VALUES[0, 0])  # cosine -1: weight 0


def test_long_sequences_match_the_formula_slot_by_slot():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 600, 8, generator=g), torch.randn(1, 2, 600, 4, generator=g)
    kept = torch.rand(1, 2, 600, generator=g) < 0.3
    out = merge_evicted_values(keys, values, ~kept, kept)  # candidates compared in steps of 256 rows
    for h in range(2):
        k, v, keep = keys[0, h], values[0, h], kept[0, h]
        unit = k / k.norm(dim=-1, keepdim=True)
        ref = v.clone()
        num, den = v.clone(), torch.ones(600)
        for e in (~keep).nonzero().flatten().tolist():
            sims = (unit[keep] @ unit[e]).tolist()
            best = max(sims)
            t = keep.nonzero().flatten()[sims.index(best)]
            w = max(best, 0.0) * v[e].norm() / (v[e].norm() + v[t].norm() + 1e-6)
            num[t] += w * v[e]
            den[t] += w
        ref[keep] = (num / den[:, None])[keep]
        assert torch.allclose(out[0, h], ref, atol=1e-5)


def test_the_compressed_store_holds_the_merged_values_of_the_kept_entries():
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(3, 200, (1, 48), generator=torch.Generator().manual_seed(3))
    spec = BudgetSpec(ratio=0.75)
    cache = kvtrim.make_cache(model, "merging", ratio=0.75)
    plain = kvtrim.make_cache(model, "knorm", ratio=0.75)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        model(input_ids=ids, past_key_values=plain, use_cache=True)
        before = layer_views(cache, torch.tensor([48]))
        keys, values = before[0].keys.clone(), before[0].values.clone()
        cache.compress()
        plain.compress()
    store, ref = cache.layers[0].store, plain.layers[0].store
    assert torch.equal(store.positions, ref.positions)  # knorm's selection
    assert torch.equal(store.keys, ref.keys)  # keys are never merged
    kept = torch.zeros(1, 2, 48, dtype=torch.bool).scatter_(-1, store.positions, True)
    expected = merge_evicted_values(keys, values, ~kept, kept).gather(
        2, store.positions[..., None].expand(-1, -1, -1, 16)
    )
    assert torch.allclose(store.values, expected) and not torch.allclose(store.values, ref.values)
    assert cache.stats().kv_bytes == plain.stats().kv_bytes == spec.keep_count(48) * 2 * 2 * 2 * 16 * 4


def test_merging_refuses_quantized_entries_and_bad_parameters(tokenizer):
    model = tiny_model("qwen2", layers=2)
    with pytest.raises(InvalidParameterError, match="merges"):
        kvtrim.generate(model, tokenizer, random_text(100, seed=1), "q?", method="merging", ratio=0.5,
                        max_new_tokens=2, kv_quant="int8")  # fmt: skip
    for params in ({"threshold": 1.5}, {"fraction": 0.0}, {"fraction": float("nan")}):
        with pytest.raises(InvalidParameterError, match=next(iter(params))):
            NearestKeyMerge(**params)
    for base in ("nope", "merging", "think"):
        with pytest.raises(InvalidParameterError, match="base"):
            get_method("merging", base=base)


def test_merging_around_a_per_head_budget_frees_what_its_base_frees():
    model = tiny_model("qwen2", layers=2)
    res = kvtrim.generate(model, byte_tokenizer(), random_text(200, seed=2), "q?", method="merging", ratio=0.75,
                          max_new_tokens=2, method_params={"base": "adakv"})  # fmt: skip
    ref = kvtrim.generate(model, byte_tokenizer(), random_text(200, seed=2), "q?", method="adakv", ratio=0.75,
                          max_new_tokens=2)  # fmt: skip
    assert res.stats.kv_entries_after == ref.stats.kv_entries_after
    assert res.stats.kv_bytes_after == ref.stats.kv_bytes_after
