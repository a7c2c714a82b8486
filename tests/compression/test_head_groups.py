"""``head_groups``: per-head methods that split by score (AdaKV, CriticalKV-AdaKV, KV-Compress) split within equal
groups of consecutive KV heads, end to end through the cache on a model with 4 KV heads."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method

LAYERS, KV_HEADS, TOKENS, KEEP = 2, 4, 160, 48


def _counts(method: str, **params) -> torch.Tensor:
    """Kept entries ``[layers, kv_heads]`` after one prefill of the one-sequence prompt, budget ``KEEP``."""
    model = tiny_model("llama", layers=LAYERS, heads=8, kv_heads=KV_HEADS, seed=3)
    ids = torch.randint(3, 200, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    cache = KVTrimCache(LAYERS, get_method(method, **params), BudgetSpec(budget=KEEP))
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache)
        cache.compress()
    return torch.stack([layer.store.entries_per_head()[0] for layer in cache.kv_layers])


@pytest.mark.parametrize("method", ["adakv", "critical_adakv"])
def test_adakv_groups_each_keep_their_share(method):
    whole = _counts(method)
    assert bool((whole.sum(-1) == KV_HEADS * KEEP).all()) and len(set(whole.flatten().tolist())) > 1
    halves = _counts(method, head_groups=2)
    assert halves.view(LAYERS, 2, 2).sum(-1).tolist() == [[2 * KEEP] * 2] * LAYERS  # each half its own share
    assert len(set(halves.flatten().tolist())) > 1  # heads within a half still differ
    assert _counts(method, head_groups=KV_HEADS).tolist() == [[KEEP] * KV_HEADS] * LAYERS  # one head a group


def test_kvcompress_groups_each_keep_their_blocks():
    bs = 16
    params = dict(even_layer_evict=True, block_size=bs, protected_window=8)
    halves = _counts("kvcompress", head_groups=2, **params)
    blocks = (-(-halves // bs)).view(LAYERS, 2, 2).sum(-1)
    assert blocks.tolist() == [[-(-2 * KEEP // bs)] * 2] * LAYERS  # every layer's half: ⌈M·2/bs⌉ blocks
    assert len(set(halves.flatten().tolist())) > 1
    across = _counts("kvcompress", head_groups=2, **{**params, "even_layer_evict": False})
    held = (-(-across // bs)).transpose(0, 1).reshape(2, -1).sum(-1)  # each half's blocks over all layers
    assert held.tolist() == [-(-KEEP * LAYERS * 2 // bs)] * 2


def test_head_groups_that_do_not_divide_the_heads_are_refused():
    with pytest.raises(InvalidParameterError, match="head_groups=3 must divide the layer's 4 KV heads"):
        _counts("adakv", head_groups=3)
