"""RestoreKV's restore tokens: KVzip's eviction plus learned entries appended within the budget."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import restore_tensors, tiny_model
from kvtrim.artifacts.restorekv import RestoreWeights
from kvtrim.artifacts.store import save_artifact
from kvtrim.compression.compressor import BudgetSpec, layer_views
from kvtrim.errors import InvalidParameterError, MissingArtifactError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method
from kvtrim.methods.registry import capabilities_of
from kvtrim.runtime import Prefill
from kvtrim.selection.restore_tokens import RestoreTokens


def restore_weights(model, tokens: int = 3, rank: int = 2, seed: int = 0, lora: float = 0.0) -> RestoreWeights:
    return RestoreWeights.from_tensors(restore_tensors(model, tokens, rank, seed, lora))


def _pipeline(model, weights: RestoreWeights, **params):
    pipe = get_method("restorekv", **params)
    pipe.append = RestoreTokens(weights=weights)
    pipe.scorer._model, pipe.scorer._repeat_ids = model, torch.tensor([5, 6, 7])  # a fixed instruction, no tokenizer
    pipe.append.bind(model)
    return pipe


def _prefill(model, pipe, ids, spec, mask=None) -> KVTrimCache:
    cache = KVTrimCache(model.config.num_hidden_layers, pipe, spec, auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    return cache


def _ids(n: int, batch: int = 1, seed: int = 4) -> torch.Tensor:
    return torch.randint(3, 200, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_ratio_zero_keeps_the_full_cache():
    model = tiny_model("llama")
    pipe = _pipeline(model, restore_weights(model, lora=1.0))
    cache = _prefill(model, pipe, _ids(30), BudgetSpec(ratio=0.0))
    full = _prefill(model, None, _ids(30), None)
    report = cache.compress()
    assert report.skipped and cache.stats().entries == full.stats().entries
    for mine, ref in zip(cache.kv_layers, full.kv_layers, strict=True):
        assert torch.equal(mine.store.keys, ref.store.keys) and torch.equal(mine.store.values, ref.store.values)


def test_no_restore_tokens_is_kvzip():
    model = tiny_model("llama")
    ids, spec = _ids(40), BudgetSpec(ratio=0.5)
    ours = _prefill(model, _pipeline(model, restore_weights(model, tokens=0)), ids, spec)
    kvzip = get_method("kvzip")
    kvzip.scorer._model, kvzip.scorer._repeat_ids = model, torch.tensor([5, 6, 7])
    ref = _prefill(model, kvzip, ids, spec)
    with torch.inference_mode():
        ours.compress(), ref.compress()
    for mine, theirs in zip(ours.kv_layers, ref.kv_layers, strict=True):
        a, b = mine.store.to_dense(), theirs.store.to_dense()
        assert torch.equal(a.positions, b.positions) and torch.equal(a.keys, b.keys)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_zero_adapter_restore_entries_are_the_models_own(family):
    """With a zero adapter, a restore token's keys and values are what the plain model computes for its embedding
    entered after the full context at the last context position."""
    model = tiny_model(family)
    weights = restore_weights(model, tokens=1)
    pipe = _pipeline(model, weights)
    ids = _ids(24)
    cache = _prefill(model, pipe, ids, BudgetSpec(ratio=0.5))
    views = layer_views(cache, torch.tensor([24]))
    with torch.inference_mode():
        assert pipe.append.reserve(views) == 1
        ref = DynamicCache()
        model(input_ids=ids, past_key_values=ref, use_cache=True)
        model(inputs_embeds=weights.embeddings[None, :1], position_ids=torch.tensor([[23]]), past_key_values=ref)
    entries = views[0].shared["restore_entries"]
    for layer in range(model.config.num_hidden_layers):
        keys, values = entries[layer]
        assert torch.allclose(keys, ref.layers[layer].keys[:, :, -1:], atol=1e-5)
        assert torch.allclose(values, ref.layers[layer].values[:, :, -1:], atol=1e-5)


def test_the_adapter_changes_the_restore_entries_only_during_their_pass():
    model = tiny_model("llama")
    ids = _ids(24)
    got = {}
    for lora in (0.0, 0.5):
        pipe = _pipeline(model, restore_weights(model, lora=lora))
        cache = _prefill(model, pipe, ids, BudgetSpec(ratio=0.5))
        views = layer_views(cache, torch.tensor([24]))
        with torch.inference_mode():
            pipe.append.reserve(views)
        got[lora] = views[0].shared["restore_entries"][1][0]
    assert not torch.allclose(got[0.0], got[0.5])
    assert not any(p._forward_hooks for p in model.modules())  # the adapter's hooks are gone after the pass


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_restore_entries_fill_part_of_the_budget(family, ratio):
    """Left-padded batch: every row holds exactly its budget (its restore entries included), the restore entries
    sit at the row's last context position, and the question that follows sees them."""
    model = tiny_model(family)
    tokens = 3
    pipe = _pipeline(model, restore_weights(model, tokens=tokens, lora=0.3))
    ids = _ids(40, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :8] = 0
    cache = _prefill(model, pipe, ids, BudgetSpec(ratio=ratio), mask)
    with torch.inference_mode():
        report = cache.compress()
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    per_row = cache.entries_per_layer_head().sum(dim=(1, 2))
    assert per_row.tolist() == [k * layers * heads for k in report.keep]
    assert report.metadata["restore_tokens"] == tokens
    for row, length in enumerate((32, 40)):
        for layer in cache.kv_layers:
            dense = layer.store.to_dense()
            pos = dense.positions[row]
            assert bool(((pos == length - 1).sum(-1) >= tokens).all())  # the restore entries (and the last token)
            assert int(pos.max()) == length - 1
    assert cache.layers[0].seen == 40  # the restore entries are not tokens seen


@pytest.mark.filterwarnings("ignore:kvzip. no tokenizer")
def test_restorekv_runs_through_generate(tmp_path, monkeypatch, tokenizer):
    import kvtrim

    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama")
    weights = restore_weights(model, lora=0.2)
    save_artifact("restorekv", model, weights.tensors(), {"settings": {"targets": ["q", "k", "v", "o"]}})
    context, question = "the quick brown fox jumps over the lazy dog " * 3, "what jumps?"
    out = kvtrim.generate(model, tokenizer, context, question, method="restorekv", ratio=0.5, max_new_tokens=4)
    full = kvtrim.generate(model, tokenizer, context, question, method=None, max_new_tokens=4)
    none = kvtrim.generate(model, tokenizer, context, question, method="restorekv", ratio=0.0, max_new_tokens=4)
    assert none.answers == full.answers
    keep = round(out.stats.context_tokens * 0.5)
    assert out.stats.kv_entries_after == keep * model.config.num_hidden_layers * model.config.num_key_value_heads


@pytest.mark.filterwarnings("ignore:kvzip. no tokenizer")
def test_missing_artifact_and_bad_use_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama", seed=7)
    with pytest.raises(MissingArtifactError, match="kvtrim calibrate restorekv"):
        get_method("restorekv").bind(model)
    with pytest.raises(InvalidParameterError, match="schedule"):
        get_method("restorekv@every:8").check(0.5, None)
    with pytest.raises(InvalidParameterError, match="artifact"):
        get_method("restorekv", artifact=3)
    ids = _ids(16)
    with pytest.raises(InvalidParameterError, match="prefill_chunk"):
        Prefill.chunked(model, ids, torch.ones_like(ids), 8, get_method("restorekv"), BudgetSpec(ratio=0.5))
    caps = capabilities_of(get_method("restorekv"))
    assert caps.artifacts == ("restorekv",) and not caps.vllm and caps.schedules == ()


def test_gradients_reach_the_embeddings_and_the_adapter():
    """Calibration trains through the restore pass: a loss on the compressed cache's next-token logits reaches the
    embeddings and both adapter matrices."""
    model = tiny_model("llama")
    weights = restore_weights(model, lora=0.1)
    params = [weights.embeddings, *(t for pair in weights.lora.values() for t in pair)]
    for p in params:
        p.requires_grad_(True)
    pipe = _pipeline(model, weights)
    pipe.append.train = True
    cache = _prefill(model, pipe, _ids(30), BudgetSpec(ratio=0.5))
    with kvtrim_attention_enabled(model):
        cache.compress()
        logits = model(input_ids=_ids(4, seed=9), past_key_values=cache, use_cache=True).logits
    logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params)
