"""Quantized entries with per-head counts (QuantizedRaggedStore) in KVTrimCache and the Python API, on a tiny
random model: bytes, closeness to the unquantized ragged store, and the padded store it replaces."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kvtrim
from conftest import random_text
from kvtrim.cache.quant import KVQuant, resolve_kv_quant
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.quantized_ragged import QuantizedRaggedStore
from kvtrim.cache.ragged import RaggedStore
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method

CTX = random_text(300, seed=1)
STEPS = 8


def _prefill(model, ids, kv_quant, method=None, ratio=None, keep_observing=False, layout=None):
    """A cache holding ``ids[:, :-STEPS]``, compressed with ``method`` (its storage ``layout`` when given)."""
    pipeline, spec = (None, None) if method is None else (get_method(method), BudgetSpec(ratio=ratio))
    if layout is not None:
        pipeline = dataclasses.replace(pipeline, layout=layout)
    cache = KVTrimCache(model.config.num_hidden_layers, pipeline, spec, kv_quant=kv_quant)
    with torch.no_grad(), kvtrim_attention_enabled(model):
        model(ids[:, :-STEPS], past_key_values=cache, use_cache=True)
        if method is not None:
            cache.compress(keep_observing=keep_observing)
    return cache


def _decode(model, ids, cache):
    """Logits ``[batch, STEPS, vocab]`` of the last ``STEPS`` tokens of ``ids`` fed one at a time."""
    out = []
    with torch.no_grad(), kvtrim_attention_enabled(model):
        for i in range(STEPS):
            tok = ids[:, ids.shape[1] - STEPS + i :][:, :1]
            out.append(model(tok, past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


def _same_selection(cache, reference):
    """Replace every layer of quantized dense ``cache`` by the entries each row of ``reference`` (a compressed,
    unquantized ragged cache of the same unpadded prompt) kept: slot = position there."""
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        assert isinstance(theirs.store, RaggedStore)
        pos = theirs.store.to_dense().positions
        mine.store = QuantizedRaggedStore.from_selection(mine.store, pos.clamp(min=0), pos >= 0)


def _ragged_bytes(store: QuantizedRaggedStore, fmt: KVQuant, d: int) -> int:
    per_entry = 2 * d * fmt.bits // 8 + 4 * d // fmt.value_group_for(d)
    return sum(n * per_entry + math.ceil(n / fmt.group_size) * 4 * d for n in store.length.tolist())


@pytest.mark.parametrize(("name", "bound"), [("int8", 0.005), ("int4", 0.05)])
def test_adakv_logits_stay_close_to_the_unquantized_ragged_store(llama, tokenizer, name, bound):
    """Same kept entries per head, quantized or not: the decoding logits differ by at most ``bound`` times the
    largest logit (the bounds of the dense store's nothing-evicted test; measured 0.12 % int8, 2.7 % int4)."""
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    reference = _prefill(llama, ids, None, "adakv", 0.875)
    counts = reference.layers[0].store.length
    assert len(set(counts.tolist())) > 1  # per-head counts
    cache = _prefill(llama, ids, name)
    _same_selection(cache, reference)
    assert cache.stats().entries == reference.stats().entries
    ref, got = _decode(llama, ids, reference), _decode(llama, ids, cache)
    err = (got - ref).abs().max()
    assert 0 < err <= bound * ref.abs().max(), (float(err), float(ref.abs().max()))
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_nothing_evicted_int8_matches_the_unquantized_cache(llama, tokenizer):
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    plain = _prefill(llama, ids, None)
    cache = _prefill(llama, ids, "int8")
    for layer in cache.layers:
        n = layer.store.length
        idx = torch.arange(n).expand(1, layer.store.kv_heads, n)
        layer.store = QuantizedRaggedStore.from_selection(layer.store, idx, torch.ones_like(idx, dtype=torch.bool))
    ref, got = _decode(llama, ids, plain), _decode(llama, ids, cache)
    assert 0 < (got - ref).abs().max() <= 0.005 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_adakv_int4_holds_fewer_bytes_than_the_padded_quantized_store(llama, tokenizer):
    """The bytes of the entries AdaKV keeps, int4 packed (key groups of 32, no window, no sink) in the ragged store,
    against the same entries held padded in the quantized dense store (every head padded to the longest)."""
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    spec, d = "int4:group_size=32,residual=0,sink=0", 16
    fmt = resolve_kv_quant(spec)
    cache = _prefill(llama, ids, spec, "adakv", 0.875)
    stores = [layer.store for layer in cache.layers]
    assert all(isinstance(s, QuantizedRaggedStore) and s.tail.length == 0 for s in stores)
    ragged = cache.kv_nbytes()
    assert ragged == sum(_ragged_bytes(s, fmt, d) for s in stores)  # exact: codes + scales of the kept entries
    padded = _prefill(llama, ids, spec, "adakv", 0.875, layout="dense")  # how the entries were held before
    assert isinstance(padded.layers[0].store, QuantizedDenseStore)
    assert padded.stats().entries == cache.stats().entries
    unquantized = _prefill(llama, ids, None, "adakv", 0.875).kv_nbytes()
    # measured: 3,264 bytes ragged, 4,792 padded, 18,432 unquantized ragged (float32)
    assert ragged * 1.25 < padded.kv_nbytes() and ragged * 4 < unquantized, (ragged, padded.kv_nbytes(), unquantized)


def test_int4_default_window_holds_each_rows_newest_kept_entries_in_full_precision(llama, tokenizer):
    """int4's default window in the ragged store (here with key groups of 32 and no sink): each row's newest 32 kept
    entries start the tail in the model's dtype (a row with fewer is padded there), the rest is packed;
    ``residual=0`` packs every kept entry. Bytes: the ragged part's formula plus the tail's float32 columns
    (measured 17,372 B against 3,264 B)."""
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    fmt, d = KVQuant("int4", group_size=32, sink=0), 16
    cache = _prefill(llama, ids, "int4:group_size=32,sink=0", "adakv", 0.875)
    packed = _prefill(llama, ids, "int4:group_size=32,residual=0,sink=0", "adakv", 0.875)
    assert cache.stats().entries == packed.stats().entries  # the same count of kept entries per row
    for layer, other in zip(cache.layers, packed.layers, strict=True):
        store = layer.store
        assert isinstance(store, QuantizedRaggedStore) and store.tail.kv_quant == fmt
        longest = int(other.store.length.max())
        assert (store.tail.length, store.tail.quantized_length) == (min(32, longest), 0)  # all in full precision
        assert torch.equal(store.length, (other.store.length - store.tail.length).clamp(min=0))
        tail_bytes = 2 * store.batch_size * store.kv_heads * store.tail.length * d * 4
        assert store.nbytes() == _ragged_bytes(store, fmt, d) + tail_bytes
    assert cache.kv_nbytes() > packed.kv_nbytes()


@pytest.mark.parametrize("method", ["adakv", "kvzip", "kvc_w8"])
def test_per_head_methods_hold_the_quantized_ragged_store_through_generate(llama, tokenizer, method):
    plain = kvtrim.generate(llama, tokenizer, CTX, ["q?", "r?"], method=method, ratio=0.875, max_new_tokens=4)
    quant = kvtrim.generate(  # every kept entry packed (no window): the bytes below are the packing's
        llama, tokenizer, CTX, ["q?", "r?"], method=method, ratio=0.875, max_new_tokens=4, kv_quant="int4:residual=0"
    )
    assert quant.stats.kv_entries_after == plain.stats.kv_entries_after
    assert quant.stats.kv_bytes_after * 3 < plain.stats.kv_bytes_after
    assert len(quant.answers) == 2


def test_recompressing_a_quantized_ragged_cache(llama, tokenizer):
    """A second compression scores the ragged store's entries through a padded quantized copy."""
    ids = tokenizer(CTX, return_tensors="pt").input_ids
    cache = _prefill(llama, ids, "int8", "adakv", 0.5, keep_observing=True)
    before = cache.stats().entries
    _decode(llama, ids, cache)
    cache.compression.budget = BudgetSpec(ratio=0.875)
    cache.compress()
    assert isinstance(cache.layers[0].store, QuantizedRaggedStore)
    assert cache.stats().entries < before


def test_a_prefills_quantized_copy_quantizes_the_kept_keys_once(llama, tokenizer):
    """``Prefill.compressed`` with ``kv_quant`` (what ``Session``, ``generate`` and ``kvtrim eval`` run): the same
    entries are kept as in a plain quantized clone (scoring reads the same quantized keys), but the kept keys are
    quantized from the prefill's float keys, so they are closer to them; the prefill is unchanged."""
    from kvtrim.runtime import Prefill, observation_of

    ids = tokenizer(CTX, return_tensors="pt").input_ids
    pipeline, spec, fmt = get_method("adakv"), BudgetSpec(ratio=0.75), resolve_kv_quant("int4")
    with torch.no_grad(), kvtrim_attention_enabled(llama):
        pre = Prefill.plain(llama, ids, torch.ones_like(ids), observation_of([pipeline]), None)
        before = [layer.store.keys.clone() for layer in pre.cache.layers]
        once = pre.compressed(pipeline, spec, fmt).cache
        twice = pre.cache.clone(pipeline, spec, fmt)  # no reference to the prefill's keys
        twice.compress(logits=pre.logits)
    for mine, theirs, src, kept_before in zip(once.layers, twice.layers, pre.cache.layers, before, strict=True):
        assert isinstance(mine.store, QuantizedRaggedStore)
        pos = mine.store.padded_positions()
        assert torch.equal(pos, theirs.store.padded_positions())
        live = pos >= 0
        float_keys = src.store.keys.gather(2, pos.clamp(min=0)[..., None].expand(-1, -1, -1, src.store.keys.shape[-1]))
        err_once = (mine.store.dequantized()[0] - float_keys)[live].norm()
        err_twice = (theirs.store.dequantized()[0] - float_keys)[live].norm()
        assert err_once < err_twice, (float(err_once), float(err_twice))
        assert torch.equal(src.store.keys, kept_before)
    assert once.kv_nbytes() == twice.kv_nbytes()
