"""A quantized cache's sink (``KVQuant.sink``) through compression and generation, on a tiny random model: every
store holds each row's oldest kept entries exactly as the model computed them, and the bytes count them."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from conftest import random_text
from kvtrim.cache.channel_pruned import ChannelPrunedStore
from kvtrim.cache.quant import KVQuant
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.quantized_ragged import QuantizedRaggedStore
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.runtime import resolve_method

CTX = random_text(300, seed=1)


def _caches(model, ids, method, kv_quant, ratio=0.75):
    """(float cache of the whole prompt, the dequantized keys of a quantized cache of the same prompt per layer
    before compression, that cache compressed by ``method``)."""
    full = KVTrimCache(model.config.num_hidden_layers)
    pipeline, spec = resolve_method(method, ratio, None, {}, model)
    quant = KVTrimCache(model.config.num_hidden_layers, pipeline, spec, kv_quant=kv_quant)
    with torch.no_grad(), kvtrim_attention_enabled(model):
        model(ids, past_key_values=full, use_cache=True)
        model(ids, past_key_values=quant, use_cache=True)
        before = [layer.store.keys.clone() for layer in quant.layers]
        quant.compress()
    return full, before, quant


def _sink_of(store):
    """``(keys [b, h, s, d], positions [b, h, s])`` of a store's sink."""
    if isinstance(store, ChannelPrunedStore):
        store = store.inner
    if isinstance(store, QuantizedRaggedStore):
        return store._sk, store._spos
    assert isinstance(store, QuantizedDenseStore)
    return store._sk, store.positions[:, :, : store.sink_length]


@pytest.mark.parametrize(("method", "layout"), [("snapkv", "dense"), ("adakv", "ragged"), ("kvzip", "ragged")])
def test_each_rows_oldest_kept_entries_stay_as_they_were(llama, tokenizer, method, layout):
    """The prompt's first entries are the model's own (the sink of the prefill); after compression each row's
    oldest kept entries form its sink and keep the values attention saw before (exact for the prompt's first
    tokens, the dequantized ones for entries that had been quantized)."""
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    full, before, quant = _caches(llama, ids, method, "int4:sink=2")
    for mine, old, ref in zip(quant.layers, before, full.layers, strict=True):
        assert torch.equal(old[:, :, :2], ref.store.keys[:, :, :2])
        assert isinstance(mine.store, QuantizedRaggedStore if layout == "ragged" else QuantizedDenseStore)
        keys, pos = _sink_of(mine.store)
        assert keys.shape[2] == 2 and bool((pos >= 0).all())
        assert torch.equal(keys, old.gather(2, pos[..., None].expand(-1, -1, -1, keys.shape[-1])))
        others = mine.store.padded_positions() if layout == "ragged" else mine.store.positions
        later = others[..., 2:]
        assert bool(((later < 0) | (later > pos.amax(-1, keepdim=True))).all())  # the oldest kept ones


def test_channel_pruned_sink_keeps_its_kept_channels(llama, tokenizer):
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    _, before, quant = _caches(llama, ids, "think", "int8:sink=1", ratio=0.5)
    store = quant.layers[0].store
    assert isinstance(store, ChannelPrunedStore)
    keys, pos = _sink_of(store)
    old = before[0].gather(2, pos[..., None].expand(-1, -1, -1, before[0].shape[-1]))
    assert keys.shape[2] == 1 and torch.equal(keys, old.gather(3, store.channels[:, :, None, :]))


@pytest.mark.parametrize(
    "kwargs",
    [{"method": "snapkv"}, {"method": "adakv", "prefill_chunk": 64}, {"method": "kvzip", "question_aware": True}],
)
def test_generation_with_a_sink_holds_its_entries_in_full_precision_bytes(llama, tokenizer, kwargs):
    args = {"ratio": 0.875, "max_new_tokens": 3, **kwargs}
    plain = kvtrim.generate(llama, tokenizer, CTX, "q?", kv_quant="int4:residual=0,sink=0", **args)
    sink = kvtrim.generate(llama, tokenizer, CTX, "q?", kv_quant="int4:residual=0,sink=1", **args)
    assert sink.stats.kv_entries_after == plain.stats.kv_entries_after
    fmt = KVQuant("int4", residual=0, sink=1)
    # one float32 entry per (layer, KV head) in place of a packed one: (2 * 4 - bits / 8) * 2 * head_dim bytes more,
    # less the share of a key group it no longer takes (at most one group's scales per row)
    cfg = llama.config
    rows = cfg.num_hidden_layers * cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    extra = sink.stats.kv_bytes_after - plain.stats.kv_bytes_after
    per_row_float = 2 * d * 4 - (2 * d * fmt.bits // 8 + 4)
    assert rows * (per_row_float - 4 * d) <= extra <= rows * per_row_float
