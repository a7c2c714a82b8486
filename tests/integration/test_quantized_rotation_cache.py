"""Rotated quantized entries (int4's default, ``kv_quant="int4:rotate=1"``) through compression and generation on a
tiny random model: the same kept entries and bytes as without rotation, logits within int4's bound of the
unquantized cache's, and key channel pruning holding the model's channels of rotated entries."""

from __future__ import annotations

import pytest
import torch
from test_quantized_cache import _decode_logits

import kvtrim
from conftest import random_text
from kvtrim.cache.channel_pruned import ChannelPrunedStore
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.quantized_ragged import QuantizedRaggedStore
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache

CTX = random_text(300, seed=1)


def test_rotated_int4_entries_decode_within_int4s_bound_at_the_same_bytes(llama, tokenizer):
    """A random model's entries have no outlier channels, so rotation has nothing to spread here (the real model's
    gain is tested in test_quantized_smollm2.py): the logits stay within int4's bound (5 % of the largest logit)
    and differ from the unrotated codes'."""
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    ref, _ = _decode_logits(llama, ids, None)
    plain, plain_cache = _decode_logits(llama, ids, "int4:group_size=16,residual=0,rotate=0")
    rotated, rot_cache = _decode_logits(llama, ids, "int4:group_size=16,residual=0,rotate=1")
    store = rot_cache.layers[0].store
    assert isinstance(store, QuantizedDenseStore) and store.kv_quant.rotate and store.quantized_length > 200
    assert rot_cache.kv_nbytes() == plain_cache.kv_nbytes()
    assert 0 < (rotated - ref).abs().max() <= 0.05 * ref.abs().max()
    assert not torch.equal(rotated, plain)


@pytest.mark.parametrize(("method", "store_type"), [("snapkv", QuantizedDenseStore), ("adakv", QuantizedRaggedStore),
                                                    ("kvzip", QuantizedRaggedStore)])  # fmt: skip
def test_methods_keep_the_same_entries_and_bytes_with_rotation(llama, tokenizer, method, store_type):
    runs = {
        spec: kvtrim.generate(llama, tokenizer, CTX, ["q?"], method=method, ratio=0.75, max_new_tokens=4, kv_quant=spec)
        for spec in ("int4:rotate=0", "int4")
    }
    plain, rotated = runs["int4:rotate=0"].stats, runs["int4"].stats
    assert rotated.kv_entries_after == plain.kv_entries_after
    # per-head counts follow scores of slightly different dequantized keys: a row may end one partial key group
    # (its per-channel scales) apart
    assert abs(rotated.kv_bytes_after - plain.kv_bytes_after) <= 0.01 * plain.kv_bytes_after
    cache = KVTrimCache(llama.config.num_hidden_layers, *kvtrim.runtime.resolve_method(method, 0.75, None, {}, llama),
                        kv_quant="int4:rotate=1")  # fmt: skip
    with torch.no_grad(), kvtrim_attention_enabled(llama):
        llama(tokenizer(CTX, return_tensors="pt").input_ids, past_key_values=cache, use_cache=True)
        cache.compress()
    assert all(isinstance(layer.store, store_type) and layer.store.kv_quant.rotate for layer in cache.layers)


@pytest.mark.parametrize("method", ["think", "think_snapkv"])
def test_key_channel_pruning_holds_the_models_channels_of_rotated_entries(llama, tokenizer, method):
    """ThinK over int4's default (rotated) entries: the kept key channels are the model's, held unrotated; the
    values stay rotated; the same entries and bytes as unrotated int4, and logits within int4's bound."""
    runs = {
        spec: kvtrim.generate(llama, tokenizer, CTX, ["q?"], method=method, ratio=0.5, max_new_tokens=4, kv_quant=spec)
        for spec in ("int4:rotate=0", "int4")
    }
    plain, rotated = runs["int4:rotate=0"].stats, runs["int4"].stats
    assert rotated.kv_entries_after == plain.kv_entries_after and rotated.kv_bytes_after == plain.kv_bytes_after
    assert len(runs["int4"].answers) == 1 and runs["int4"].answers[0]
    cache = KVTrimCache(llama.config.num_hidden_layers, *kvtrim.runtime.resolve_method(method, 0.5, None, {}, llama),
                        kv_quant="int4")  # fmt: skip
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    with torch.no_grad(), kvtrim_attention_enabled(llama):
        llama(ids, past_key_values=cache, use_cache=True)
        cache.compress()
        logits = llama(ids[:, -1:], past_key_values=cache, use_cache=True).logits
    for layer in cache.layers:
        store = layer.store
        assert isinstance(store, ChannelPrunedStore) and store.kept_channels < store.head_dim
        assert store.inner.kv_quant.rotate and not store.inner.key_format.rotate
    assert torch.isfinite(logits).all()
