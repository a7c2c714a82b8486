"""Compression works layer by layer: while compressing, the bytes held by live tensors never exceed the cache plus
one layer's K/V plus the scores being ranked (and one layer's scoring intermediates), never a second cache."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import tiny_model
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method


class LiveBytes(TorchDispatchMode):
    """Bytes held by live tensor storages: the ones registered with :meth:`track` plus every storage an op
    allocates while the mode is active; each is subtracted when its storage is freed. ``peak`` is the maximum."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._seen:
            return
        self._seen.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def cache_tensors(cache: KVTrimCache) -> list[torch.Tensor]:
    """Every tensor a compression may free: stored entries, bookkeeping, statistics and observations."""
    out = []
    for layer in cache.kv_layers:
        store = layer.store
        out += [store._k, store._v, store._pos, *store._stats.values()]
        obs = layer.observation
        out += [t for t in (obs.queries, obs.positions) if t is not None]
    return out


def prefilled(method: str, batch: int = 2, tokens: int = 192, layers: int = 4) -> KVTrimCache:
    model = tiny_model("llama", layers=layers, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (batch, tokens), generator=torch.Generator().manual_seed(0))
    cache = KVTrimCache(layers, get_method(method), BudgetSpec(ratio=0.75))
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache)
    return cache


@pytest.mark.parametrize(("method", "layout"), [("snapkv", "dense"), ("adakv", "ragged"), ("pyramidkv", "dense")])
def test_compression_peak_is_one_layer_above_the_cache(method, layout):
    cache = prefilled(method)
    layers = cache.kv_layers
    first = layers[0].store
    b, h, s, _ = first.keys.shape
    layer_kv = max(layer.store.nbytes() for layer in layers)
    scores = len(layers) * b * h * s * 4  # fp32 scores of every layer, ranked together by the budget allocator
    # Scoring one layer may materialise its window attention, [batch, q_heads, window, seq] in fp32.
    window = cache.observation_spec.window
    intermediates = b * 2 * h * window * s * 4
    meter = LiveBytes()
    for t in cache_tensors(cache):
        meter.track(t)
    before = meter.live
    with torch.inference_mode(), meter:
        cache.compress()
    assert {layer.store.layout for layer in cache.layers} == {layout}
    extra = meter.peak - before
    assert extra <= layer_kv + scores + intermediates, (extra, layer_kv, scores, intermediates)
    # A second copy of every layer would be at least the whole compressed cache again on top of the original.
    assert meter.live < before
