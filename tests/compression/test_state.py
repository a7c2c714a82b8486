"""CompressionState: the policy of one cache (when to compress, reports, counters), separate from its storage."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from conftest import tiny_model
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.compression.state import CompressionState
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method


def test_public_cache_is_the_integration_adapter():
    assert kvtrim.KVTrimCache is KVTrimCache


def test_pipeline_without_budget_is_rejected():
    with pytest.raises(InvalidParameterError, match="needs a budget"):
        CompressionState(get_method("snapkv"), None)


def test_policy_attributes_are_the_states():
    cache = KVTrimCache(2, get_method("snapkv"), BudgetSpec(budget=8))
    assert cache.observing and cache.compression.observing
    cache.observing = False  # callers (kvtrim.api, eval) switch observation through the cache
    assert cache.compression.observing is False
    assert cache.reports is cache.compression.reports and cache.pipeline is cache.compression.pipeline


def test_state_compresses_on_the_forward_after_prefill_and_refuses_a_second_prompt():
    model = tiny_model()
    cache = KVTrimCache(model.config.num_hidden_layers, get_method("snapkv"), BudgetSpec(budget=8))
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        assert cache.compression.prefilled_uncompressed and cache.compressions == 0
        model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)  # compresses first, then attends
        assert cache.compressions == 1 and cache.last_report.entries_after < cache.last_report.entries_before
        assert cache.entries_per_layer_head().max().item() <= 8 + 1
        with pytest.raises(InvalidParameterError, match="already used by a generate call"):
            model(input_ids=ids[:, :4], past_key_values=cache, use_cache=True)
