"""Decoding-time methods for long generations (kvtrim.methods.reasoning) on a tiny model."""

from __future__ import annotations

import pytest
import torch

from conftest import random_text, tiny_model
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.methods import get_method
from kvtrim.runtime import Prefill, greedy_decode


def _decode(model, tokenizer, pipeline, spec, steps, n=120):
    ids = tokenizer(random_text(n, seed=7), return_tensors="pt")["input_ids"]
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre = Prefill.plain(model, ids, torch.ones_like(ids), pipeline.observation)
        cache = pre.cache.clone(pipeline, spec)
        cache.compress()
        held = []
        before_forward = cache._before_forward

        def watch(new_tokens):  # entries before the schedule acts at each step: the high-water mark
            held.append(int(cache.entries_per_layer_head().max()))
            before_forward(new_tokens)

        cache._before_forward = watch
        out = greedy_decode(model, cache, pre.mask, pre.logits, steps + 1, set(), 0)
    return out, cache, held, pre


def test_rkv_holds_the_cache_between_budget_and_budget_plus_buffer_while_decoding(tokenizer):
    model = tiny_model("llama", kv_heads=2)
    budget, buffer, steps = 40, 16, 150
    _, cache, held, _ = _decode(model, tokenizer, get_method("rkv", window=4, buffer=buffer), BudgetSpec(budget=budget),
                                steps)  # fmt: skip
    assert max(held) <= budget + buffer + 1  # the budget, the buffer, the step's own token
    assert cache.compressions >= steps // buffer
    assert int(cache.entries_per_layer_head().min()) >= budget


def test_rkv_with_a_budget_above_the_context_keeps_everything(tokenizer):
    model = tiny_model("llama")
    out, cache, _, pre = _decode(model, tokenizer, get_method("rkv"), BudgetSpec(budget=10_000), 12)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        full = greedy_decode(model, pre.cache, pre.mask, pre.logits, 13, set(), 0)
    assert out.tokens == full.tokens
    assert int(cache.entries_per_layer_head().min()) == cache.layers[0].seen


def test_rkv_buffer_shorter_than_its_window_is_refused():
    with pytest.raises(InvalidParameterError, match="buffer must be an integer >= window"):
        get_method("rkv", window=8, buffer=4)


def test_triattention_holds_the_cache_between_budget_and_budget_plus_buffer_while_decoding(tokenizer):
    model = tiny_model("llama", kv_heads=2)
    budget, buffer, steps = 40, 16, 100
    _, cache, held, _ = _decode(model, tokenizer, get_method("triattention", buffer=buffer), BudgetSpec(budget=budget),
                                steps)  # fmt: skip
    assert max(held) <= budget + buffer + 1
    assert cache.compressions >= steps // buffer
    assert int(cache.entries_per_layer_head().min()) >= budget


def test_triattention_with_a_budget_above_the_context_keeps_everything(tokenizer):
    model = tiny_model("llama")
    out, cache, _, pre = _decode(model, tokenizer, get_method("triattention"), BudgetSpec(budget=10_000), 12)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        full = greedy_decode(model, pre.cache, pre.mask, pre.logits, 13, set(), 0)
    assert out.tokens == full.tokens
    assert int(cache.entries_per_layer_head().min()) == cache.layers[0].seen


def test_triattention_refuses_bad_parameters():
    with pytest.raises(InvalidParameterError, match="buffer must be an integer >= 1"):
        get_method("triattention", buffer=0)
    with pytest.raises(InvalidParameterError, match="stats_window must be an integer >= 1"):
        get_method("triattention", stats_window=0)
