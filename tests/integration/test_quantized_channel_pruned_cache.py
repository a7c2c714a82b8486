"""ThinK (key-channel pruning) with quantized entries, end to end on the tiny test models: the kept keys are
stored with fewer channels AND packed, bytes come from the tensors."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from conftest import random_text
from kvtrim.cache.channel_pruned import ChannelPrunedStore
from kvtrim.cache.quant import KVQuant, packed_width
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.quantized_ragged import QuantizedRaggedStore

CTX = random_text(300, seed=1)
LAYERS, KV_HEADS, D, ELEM = 2, 2, 16, 4  # the tiny Llama: head_dim 16, float32


def _expected_bytes(entries_per_head: int, kept: int, fmt: KVQuant) -> int:
    """Bytes of a quantized dense layer set holding ``entries_per_head`` entries per head, keys on ``kept``
    channels, right after a compaction: packed codes + float16 scales and zero points (the last key group possibly
    partial) + the float32 window and sink (``fmt.residual`` and ``fmt.sink`` entries: int4's default 32 and 1)."""
    nq = max(entries_per_head - fmt.sink - fmt.residual, 0)
    w = entries_per_head - nq
    groups = -(-nq // fmt.group_size)
    per_head = nq * (packed_width(kept, fmt.bits) + D * fmt.bits // 8 + 4) + groups * kept * 4 + w * (kept + D) * ELEM
    return LAYERS * KV_HEADS * per_head


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("method, ratio, kept", [("think", 0.5, 8), ("think", 0.45, 9), ("think_snapkv", 0.5, 8)])
def test_think_generates_with_quantized_entries(llama, tokenizer, name, method, ratio, kept):
    plain = kvtrim.generate(llama, tokenizer, CTX, "q?", method=method, ratio=ratio, max_new_tokens=4)
    res = kvtrim.generate(llama, tokenizer, CTX, "q?", method=method, ratio=ratio, max_new_tokens=4, kv_quant=name)
    st = res.stats
    assert len(res.answers) == 1 and isinstance(res.answers[0], str)
    assert st.compression_metadata["key_channels_kept"] == kept
    assert st.kv_entries_after == plain.stats.kv_entries_after
    per_head = st.kv_entries_after // (LAYERS * KV_HEADS)
    assert st.kv_bytes_after == _expected_bytes(per_head, kept, KVQuant(name))
    assert st.kv_bytes_after < plain.stats.kv_bytes_after


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_think_cache_holds_pruned_packed_keys_and_decodes(llama, name):
    ids = torch.randint(5, 250, (2, 140))
    with torch.no_grad():
        cache = kvtrim.make_cache(llama, "think", ratio=0.25, kv_quant=name)
        out = llama.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 145)
    for layer in cache.layers:
        store = layer.store
        assert isinstance(store, ChannelPrunedStore) and isinstance(store.inner, QuantizedDenseStore)
        assert store.kv_quant == KVQuant(name) and store.kept_channels == 12
        assert store.keys.shape == (2, 2, 144, 12) and store.values.shape == (2, 2, 144, 16)
        # the prompt's 140 entries were compacted (every entry but the sink and the window quantized, the last key
        # group partial), then 4 decoding steps wait in the window: 140 quantized (int8), 108 (int4, its 32-entry
        # window; no sink by default)
        fmt = KVQuant(name)
        nq = 140 - fmt.residual - fmt.sink
        assert store.inner.quantized_length == nq and store.inner.window_length == 144 - nq - fmt.sink
        assert store.inner.sink_length == fmt.sink
        assert store.inner.partial_group == (nq // fmt.group_size * fmt.group_size, nq % fmt.group_size)
        assert store.inner._kc.shape[-1] == packed_width(12, KVQuant(name).bits)
    with pytest.raises(kvtrim.InvalidParameterError, match="channel-pruned"):
        cache.compress()


@pytest.mark.parametrize("method", ["think", "think_snapkv"])
def test_a_padded_batch_prunes_the_quantized_ragged_store(llama, tokenizer, method):
    contexts = [random_text(300, seed=1), random_text(200, seed=2)]
    args = {"method": method, "ratio": 0.5, "max_new_tokens": 3}
    plain = kvtrim.generate(llama, tokenizer, contexts, ["q?", "r?"], **args)
    spec = "int4:residual=0"  # every kept entry packed: the bytes below are the packing's
    with kvtrim.compressing(llama, method, ratio=0.5, kv_quant=spec) as cache:
        ids = tokenizer(contexts, return_tensors="pt", padding=True)
        llama.generate(**ids, max_new_tokens=3, do_sample=False)
    store = cache.layers[0].store
    assert isinstance(store, ChannelPrunedStore) and isinstance(store.inner, QuantizedRaggedStore)
    res = kvtrim.generate(llama, tokenizer, contexts, ["q?", "r?"], kv_quant=spec, **args)
    assert res.stats.kv_entries_after == plain.stats.kv_entries_after
    assert res.stats.kv_bytes_after < plain.stats.kv_bytes_after / 3
    assert len(res.answers) == 2

