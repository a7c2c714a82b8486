"""Decoding-time schedules and chunked prefill on tiny models."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from conftest import random_text, tiny_model
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.compression.schedule import AfterPrefill, EveryNTokens, OverBudget, TailFull, parse_schedule
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.methods import get_method
from kvtrim.runtime import Prefill, greedy_decode
from kvtrim.scoring.partitions import kept_length


def _ids(tokenizer, n, seed=0):
    return tokenizer(random_text(n, seed), return_tensors="pt")["input_ids"]


def _prefilled(model, ids, pipeline, spec):
    pre = Prefill.plain(model, ids, torch.ones_like(ids), pipeline.observation)
    cache = pre.cache.clone(pipeline, spec)
    cache.compress()
    return pre, cache


def test_parse_schedule():
    assert parse_schedule("prefill") == AfterPrefill()
    assert parse_schedule("every:8") == EveryNTokens(8)
    assert parse_schedule("over") == OverBudget(0)
    assert parse_schedule("tail:64", sink=4) == TailFull(64, 4)
    for bad in ("every:0", "every:x", "over:-1", "sometimes"):
        with pytest.raises(InvalidParameterError, match=r"schedule|every|slack"):
            parse_schedule(bad)


def test_tail_schedule_needs_a_partition_method():
    with pytest.raises(InvalidParameterError, match="lag-partition method"):
        get_method("snapkv@tail:32")


def test_lagkv_needs_a_ratio(llama, tokenizer):
    with pytest.raises(InvalidParameterError, match="takes ratio"):
        kvtrim.generate(llama, tokenizer, random_text(200), "q", method="lagkv", budget=64)


def test_lagkv_one_pass_keeps_eq12_count(llama, tokenizer):
    ids = _ids(tokenizer, 700)
    with torch.inference_mode(), kvtrim_attention_enabled(llama):
        _, cache = _prefilled(llama, ids, get_method("lagkv", sink=4, lag=32), BudgetSpec(ratio=0.75))
    expected = kept_length(ids.shape[1], 4, 32, 8)
    assert (cache.entries_per_layer_head() == expected).all()


@pytest.mark.parametrize(("name", "slack"), [("snapkv@over:0", 0), ("h2o@over:8", 8), ("adakv@every:16", 16)])
def test_decoding_time_compression_stays_within_budget(tokenizer, name, slack):
    model, budget, steps = tiny_model("llama", kv_heads=2), 48, 200
    ids = _ids(tokenizer, 150, seed=3)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre, cache = _prefilled(model, ids, get_method(name), BudgetSpec(budget=budget))
        held = []
        before_forward = cache._before_forward

        def watch(new_tokens):  # entries at every step boundary, before the schedule acts: the high-water mark
            held.append(cache.entries_per_layer_head().float())
            before_forward(new_tokens)

        cache._before_forward = watch
        greedy_decode(model, cache, pre.mask, pre.logits, steps + 1, set(), 0)
    assert len(held) == steps and cache.layers[0].seen == ids.shape[1] + steps
    worst = torch.stack(held)
    if name.startswith("adakv"):  # heads vary within a layer; the layer mean is the budget
        worst = worst.mean(-1)
    assert float(worst.max()) <= budget + slack + 1  # the budget, the schedule's slack, the step's own token
    assert cache.compressions > (5 if slack else steps // 2)


def test_lagkv_recursive_decoding_bounds_the_tail(llama, tokenizer):
    ids = _ids(tokenizer, 300)
    lag, sink = 16, 4
    with torch.inference_mode(), kvtrim_attention_enabled(llama):
        pre, cache = _prefilled(llama, ids, get_method("lagkv", sink=sink, lag=lag), BudgetSpec(ratio=0.5))
        greedy_decode(llama, cache, pre.mask, pre.logits, 200, set(), 0)
    seen = cache.layers[0].seen
    until = cache.layers[0].compressed_until
    assert seen - int(until) <= 2 * lag  # a tail of 2L is compressed before the next token is stored
    compressed_tokens = int(until) - sink
    assert compressed_tokens % lag == 0
    # sink + half of every compressed partition + the uncompressed tail
    expected = sink + compressed_tokens // 2 + (seen - int(until))
    assert (cache.entries_per_layer_head() == expected).all()
    assert cache.compressions > 10


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chunked_prefill_without_eviction_equals_prefill(tokenizer, family):
    model = tiny_model(family)
    ids = _ids(tokenizer, 230, seed=5)
    mask = torch.ones_like(ids)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        full = Prefill.plain(model, ids, mask, get_method("snapkv").observation)
        chunked = Prefill.chunked(model, ids, mask, 64, get_method("snapkv"), BudgetSpec(budget=10_000))
        torch.testing.assert_close(chunked.logits, full.logits, atol=1e-5, rtol=1e-4)
        a = greedy_decode(model, full.cache, full.mask, full.logits, 20, set(), 0)
        b = greedy_decode(model, chunked.cache, chunked.mask, chunked.logits, 20, set(), 0)
    assert a.tokens == b.tokens


def test_chunked_prefill_bounds_memory(llama, tokenizer):
    ids = _ids(tokenizer, 600, seed=6)
    with torch.inference_mode(), kvtrim_attention_enabled(llama):
        chunked = Prefill.chunked(llama, ids, torch.ones_like(ids), 50, get_method("snapkv"), BudgetSpec(budget=64))
        full = Prefill.plain(llama, ids, torch.ones_like(ids), get_method("snapkv").observation)
    per_entry = 2 * 16 * 4  # K and V, head_dim 16, fp32
    bound = 2 * 2 * (64 + 50) * per_entry * 2  # layers x kv_heads x (budget + chunk), dense growth slack x2
    assert chunked.cache.peak_kv_bytes <= bound < full.cache.stats().kv_bytes


def test_batches_with_padding_and_decoding_schedule(tokenizer):
    model = tiny_model("mistral")
    contexts = [random_text(400, 1), random_text(260, 2)]
    res = kvtrim.generate(
        model,
        tokenizer,
        contexts,
        ["what?", "who?"],
        method="lagkv",
        ratio=0.5,
        max_new_tokens=40,
        method_params={"sink": 4, "lag": 32},
    )
    alone = [
        kvtrim.generate(
            model, tokenizer, c, q, method="lagkv", ratio=0.5, max_new_tokens=40, method_params={"sink": 4, "lag": 32}
        ).answers[0]
        for c, q in zip(contexts, ["what?", "who?"], strict=True)
    ]
    assert [a[0] for a in res.answers] == alone
    assert res.stats.compressions >= 1


def test_chunked_generate_matches_per_row_and_reports_peak(llama, tokenizer):
    ctx = random_text(500, 9)
    whole = kvtrim.generate(llama, tokenizer, ctx, "q?", method="snapkv", budget=10_000, max_new_tokens=8)
    chunked = kvtrim.generate(
        llama, tokenizer, ctx, "q?", method="snapkv", budget=10_000, max_new_tokens=8, prefill_chunk=100
    )
    assert chunked.answers == whole.answers
    small = kvtrim.generate(
        llama, tokenizer, ctx, "q?", method="snapkv", budget=48, max_new_tokens=8, prefill_chunk=100
    )
    assert small.stats.peak_kv_bytes < whole.stats.peak_kv_bytes
    assert small.stats.prefill_chunk == 100
    with pytest.raises(InvalidParameterError, match="prefill_chunk"):
        kvtrim.generate(llama, tokenizer, ctx, "q?", method="snapkv", budget=48, prefill_chunk=0)


def test_lagkv_inside_model_generate_compresses_while_decoding(llama, tokenizer):
    ids = _ids(tokenizer, 200, seed=4)
    with kvtrim.compressing(llama, "lagkv", ratio=0.5, sink=4, lag=16) as cache:
        out = llama.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=100,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            past_key_values=cache,
        )
    assert out.shape[1] == ids.shape[1] + 100
    assert cache.compressions >= 100 // 16  # after the prompt, then once every 16 generated tokens
    seen = cache.layers[0].seen
    assert seen - int(cache.layers[0].compressed_until) <= 2 * 16
    assert int(cache.entries_per_layer_head().max()) < seen
