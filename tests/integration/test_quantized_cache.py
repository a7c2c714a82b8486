"""Quantized entries (kv_quant) in KVTrimCache and the Python API, on tiny random models."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvtrim
from conftest import VOCAB, random_text
from kvtrim.cache.dense import DenseStore
from kvtrim.cache.quant import KVQuant, resolve_kv_quant
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache

CTX = random_text(300, seed=1)


def _decode_logits(model, ids, kv_quant, steps=8):
    """Logits of ``steps`` decoding steps after prefilling ``ids[:, :-steps]`` into a cache with ``kv_quant``."""
    cache = KVTrimCache(model.config.num_hidden_layers, kv_quant=kv_quant)
    out = []
    with torch.no_grad(), kvtrim_attention_enabled(model):
        model(ids[:, :-steps], past_key_values=cache, use_cache=True)
        for i in range(steps):
            tok = ids[:, ids.shape[1] - steps + i :][:, :1]
            out.append(model(tok, past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1), cache


def test_without_kv_quant_the_store_is_the_plain_dense_one(llama, tokenizer):
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    logits, cache = _decode_logits(llama, ids, None)
    assert all(type(layer.store) is DenseStore for layer in cache.layers)
    with torch.no_grad():
        plain = llama(ids).logits[:, -8:]
    assert torch.allclose(logits, plain, atol=1e-4)


@pytest.mark.parametrize(("name", "bound"), [("int8", 0.005), ("int4", 0.05)])
def test_quantized_cache_logits_stay_close(llama, tokenizer, name, bound):
    """Nothing evicted: the decoding logits differ from the unquantized cache's by at most ``bound`` times the
    largest logit (measured: 0.13 % for int8, 1.7 % for int4 on this model)."""
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    ref, _ = _decode_logits(llama, ids, None)
    got, cache = _decode_logits(llama, ids, name)
    store = cache.layers[0].store
    fmt = KVQuant(name)
    nq = (ids.shape[1] - fmt.residual) // fmt.group_size * fmt.group_size  # whole groups before the window
    assert isinstance(store, QuantizedDenseStore) and store.quantized_length == nq
    err = (got - ref).abs().max()
    assert 0 < err <= bound * ref.abs().max()


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_bytes_held_are_entries_times_packed_size(llama, tokenizer, name):
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    _, cache = _decode_logits(llama, ids, name)
    fmt = KVQuant(name)
    layers, heads, d, n = 2, 2, 16, ids.shape[1]
    nq = (n - fmt.residual) // fmt.group_size * fmt.group_size  # int4's default window: 32..63 entries
    assert 32 <= n - nq <= 63 if name == "int4" else n - nq < fmt.group_size
    per_entry = fmt.entry_bytes(d)  # codes + the entry's share of key and value scales
    window = (n - nq) * 2 * d * 4  # float32 model
    assert cache.stats().entries == layers * heads * n
    assert cache.kv_nbytes() == layers * heads * (nq * per_entry + window)


def _head_dim_64_model(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("spec", "fraction"), [("int4:group_size=64,residual=0", 1 / 28), ("int4:residual=0", 1 / 26.9)]
)
def test_snapkv_ratio_0875_with_int4_holds_at_most_1_28_of_the_fp16_cache(tokenizer, spec, fraction):
    """The target of docs/quantization.md, at 4,096 context tokens and head_dim 64 without a full-precision window
    (int4's default window of 32 entries is measured at 32k tokens in tests/cache/test_quantized_dense.py): 1/8 of
    the entries, each at 64 + 8 bytes (key groups of 64) instead of 256; with int4's key groups of 32, 64 + 12
    bytes: 1/26.9."""
    model = _head_dim_64_model()
    context = random_text(4096, seed=2)
    fmt = resolve_kv_quant(spec)
    result = kvtrim.generate(
        model, tokenizer, context, "q?", method="snapkv", ratio=0.875, kv_quant=fmt, max_new_tokens=1
    )
    s = result.stats
    full_fp16 = s.kv_entries_before * 2 * 64 * 2  # keys + values, head_dim 64, 2 bytes each
    assert s.kv_entries_after * 8 <= s.kv_entries_before + 2 * 8  # 1/8 of the entries kept (per layer, rounded up)
    assert s.kv_bytes_after <= full_fp16 * fraction, (s.kv_bytes_after, full_fp16 * fraction)
    # the same without quantization holds 1/8 of the (float32) bytes: the saving is the entry format's
    plain = kvtrim.generate(model, tokenizer, context, "q?", method="snapkv", ratio=0.875, max_new_tokens=1)
    assert plain.stats.kv_entries_after == s.kv_entries_after
    assert s.kv_bytes_after * 0.95 * (2 * 64 * 4) / fmt.entry_bytes(64) < plain.stats.kv_bytes_after


@pytest.mark.parametrize("method", ["snapkv", "streaming_llm", "tova", "pyramidkv", "kvzip", "lagkv"])
def test_eviction_methods_compose_with_int8(llama, tokenizer, method):
    plain = kvtrim.generate(llama, tokenizer, CTX, ["q?", "r?"], method=method, ratio=0.5, max_new_tokens=4)
    quant = kvtrim.generate(
        llama, tokenizer, CTX, ["q?", "r?"], method=method, ratio=0.5, max_new_tokens=4, kv_quant="int8"
    )
    assert quant.stats.kv_entries_after == plain.stats.kv_entries_after
    assert quant.stats.kv_bytes_after < plain.stats.kv_bytes_after
    assert len(quant.answers) == 2


def test_scoring_reads_the_dequantized_keys(llama, tokenizer, monkeypatch):
    """The keys a scorer sees are the stored keys as attention dequantizes them."""
    from kvtrim.compression import compressor

    seen = []
    original = compressor.layer_views

    def spy(cache, *args, **kwargs):
        views = original(cache, *args, **kwargs)
        seen.append([(v.keys.clone(), cache.layers[v.layer_idx].store) for v in views])
        return views

    monkeypatch.setattr(compressor, "layer_views", spy)
    spec = "int4:sink=0,rotate=0"  # codes in the model's channels, the first key group from the first slot
    kvtrim.generate(llama, tokenizer, CTX, "q?", method="snapkv", ratio=0.5, max_new_tokens=2, kv_quant=spec)
    keys, store = seen[0][0]
    assert isinstance(store, QuantizedDenseStore)
    # the view's keys are quantized values (not the float entries): at most 16 distinct levels per channel group
    levels = keys[0, 0, : store.kv_quant.group_size, 0].unique().numel()
    assert levels <= 16


def test_compressing_and_make_cache_take_kv_quant(llama, tokenizer):
    ids = tokenizer(CTX, return_tensors="pt")
    with kvtrim.compressing(llama, "snapkv", ratio=0.5, kv_quant="int4") as cache:
        llama.generate(**ids, max_new_tokens=3, do_sample=False)
    assert isinstance(cache.layers[0].store, QuantizedDenseStore)
    assert cache.last_report is not None and cache.last_report.entries_after < cache.last_report.entries_before
    made = kvtrim.make_cache(llama, "snapkv", ratio=0.5, kv_quant="int8")
    assert made.kv_quant == KVQuant("int8")


@pytest.mark.parametrize("bad", ["fp4", "INT8", 8, True])
def test_invalid_kv_quant_raises_naming_the_parameter(llama, tokenizer, bad):
    match = r"kv_quant must be one of \('int8', 'int4', 'fp8'\) or None"
    with pytest.raises(InvalidParameterError, match=match):
        kvtrim.generate(llama, tokenizer, CTX, "q?", ratio=0.5, kv_quant=bad)
    with pytest.raises(InvalidParameterError, match=match):
        kvtrim.make_cache(llama, "snapkv", ratio=0.5, kv_quant=bad)
    with pytest.raises(InvalidParameterError, match=match):
        KVTrimCache(2, kv_quant=bad)


def test_channel_pruning_composes_with_quantized_entries(llama, tokenizer):
    """ThinK used to refuse kv_quant; its pruned keys are now held packed (tests/integration/
    test_quantized_channel_pruned_cache.py)."""
    plain = kvtrim.generate(llama, tokenizer, CTX, "q?", method="think", ratio=0.5, max_new_tokens=3)
    quant = kvtrim.generate(llama, tokenizer, CTX, "q?", method="think", ratio=0.5, max_new_tokens=3, kv_quant="int8")
    assert quant.stats.kv_entries_after == plain.stats.kv_entries_after
    assert quant.stats.compression_metadata["key_channels_kept"] == 8
    assert quant.stats.kv_bytes_after < plain.stats.kv_bytes_after / 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefill_chunk": 64},  # quantized from the first chunk, compressed between chunks
        {"question_aware": True},
        {"method": "adakv"},  # per-head counts: the quantized ragged store
        {"method": "adakv", "prefill_chunk": 64},  # a ragged store compressed again after every chunk
        {"method": "adakv", "question_aware": True},  # the question appended to a ragged store's tail
    ],
)
def test_modes_compose_with_int4(llama, tokenizer, kwargs):
    args = {"method": "snapkv", "ratio": 0.5, "max_new_tokens": 3, **kwargs}
    plain = kvtrim.generate(llama, tokenizer, CTX, "q?", **args)
    quant = kvtrim.generate(llama, tokenizer, CTX, "q?", kv_quant="int4", **args)
    assert quant.stats.kv_entries_after == plain.stats.kv_entries_after
    assert quant.stats.kv_bytes_after < plain.stats.kv_bytes_after


def test_left_padded_batch_with_int8_matches_each_row_alone(llama, tokenizer):
    """Padding slots stay masked in a quantized store: each row of a batch answers as it does alone."""
    contexts = [CTX, random_text(200, seed=5)]
    batch = kvtrim.generate(llama, tokenizer, contexts, ["q?", "q?"], method=None, max_new_tokens=4, kv_quant="int8")
    alone = [
        kvtrim.generate(llama, tokenizer, c, "q?", method=None, max_new_tokens=4, kv_quant="int8") for c in contexts
    ]
    assert batch.answers[0] == alone[0].answers
    # the padded row's key groups start at its first padding slot, not at its first token: other tokens share a
    # scale than when it runs alone, so only the first answer tokens are compared
    assert batch.answers[1][0][:2] == alone[1].answers[0][:2]


def test_a_cache_resolves_kv_quant_and_a_clone_names_both_settings():
    cache = KVTrimCache(2, kv_quant="int4")
    assert cache.kv_quant == KVQuant("int4", group_size=64, residual=32, sink=1, rotate=True)
    assert cache.clone(kv_quant="int4:group_size=64,residual=32,sink=1,rotate=1").kv_quant == cache.kv_quant
    match = (r"kv_quant='int4:group_size=64,residual=0,sink=1,rotate=1': this cache already holds "
             r"int4:group_size=64,residual=32,sink=1,rotate=1 entries")  # fmt: skip
    with pytest.raises(InvalidParameterError, match=match):
        cache.clone(kv_quant="int4:residual=0")
