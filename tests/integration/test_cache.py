"""KVTrimCache inside transformers: exactness, real compaction, positions, batching."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvtrim
from conftest import (
    ARTIFACT_METHODS,
    CHANNEL_METHODS,
    ELASTIC_METHODS,
    GLOBAL_BLOCK_METHODS,
    GLOBAL_TOKEN_METHODS,
    QUESTION_WINDOW_PARAMS,
    RATIO_ONLY_METHODS,
    WHOLE_CHUNK_METHODS,
    byte_tokenizer,
    install_head_scores,
    random_text,
    tiny_model,
)
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method, method_names
from kvtrim.scoring.partitions import kept_length


def hf_greedy(model, ids, mask, n):
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None
    )


@pytest.mark.parametrize("method", method_names())
def test_budget_at_or_above_context_is_token_identical(family_model, method, monkeypatch, tmp_path):
    if method in ARTIFACT_METHODS:
        install_head_scores(family_model, monkeypatch, tmp_path)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ref = hf_greedy(family_model, ids, mask, 12)
    # Ratio-only methods (LagKV) keep everything at ratio 0; the others at a budget >= the context.
    ratio_only = method in RATIO_ONLY_METHODS or method == "think"  # think's ratio is a key-channel fraction
    specs = [{"ratio": 0.0}] if ratio_only else [{"budget": 40}, {"budget": 500}]
    for spec in specs:
        with kvtrim.compressing(family_model, method, **spec) as cache:
            out = family_model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                past_key_values=cache,
            )
        assert torch.equal(out, ref), (method, spec)
        report = cache.last_report
        assert report is not None
        # A budget that may keep less than the request (a threshold, lazy layers) has to run; it evicts nothing here
        if get_method(method).budget.keeps_below_request:
            assert report.entries_after == report.entries_before, (method, spec)
        else:
            assert report.skipped, (method, spec)


def test_compressing_restores_attention_implementation(llama):
    before = llama.config._attn_implementation
    with kvtrim.compressing(llama, "snapkv", ratio=0.5):
        assert llama.config._attn_implementation == "kvtrim"
    assert llama.config._attn_implementation == before


@pytest.mark.parametrize("method", method_names())
def test_kept_counts_and_bytes_match_budget(method, monkeypatch, tmp_path):
    if method == "think":
        pytest.skip("think evicts no token (its ratio is a key-channel fraction); tests/test_think_duo_methods.py")
    model = tiny_model("llama", layers=3)
    if method in ARTIFACT_METHODS:
        install_head_scores(model, monkeypatch, tmp_path)
    ids = torch.randint(3, 200, (1, 64), generator=torch.Generator().manual_seed(2))
    if method in RATIO_ONLY_METHODS:
        pipeline, spec = get_method(method, sink=4, lag=8), BudgetSpec(ratio=0.5)
    elif method == "compilerkv_elastic":  # a bare forward records no prompt log-probs for the perplexity bin
        pipeline, spec = get_method(method, missing_logprobs="median_bin"), BudgetSpec(budget=20)
    else:
        pipeline, spec = get_method(method, **QUESTION_WINDOW_PARAMS.get(method, {})), BudgetSpec(budget=20)
    cache = KVTrimCache(3, pipeline.bind(model), spec, auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        full = cache.stats()
        report = cache.compress()
    per_head = cache.entries_per_layer_head()
    budgets = report.budgets
    if method in ELASTIC_METHODS or method in WHOLE_CHUNK_METHODS:  # at most the budget, one set per layer
        assert bool((per_head <= budgets).all()) and bool((per_head >= 1).all())
        assert bool((per_head == per_head[..., :1]).all())
        return
    assert torch.equal(per_head, budgets)
    head_dim, kv_heads = 16, 2
    stats = cache.stats()
    assert full.entries == 64 * 3 * kv_heads
    assert stats.entries == int(budgets.sum())
    assert report.entries_after == stats.entries < full.entries
    if method in ("pyramidkv",):  # layer budgets decrease with depth, mean near the budget
        assert per_head[0, 0, 0] >= per_head[0, -1, 0]
    elif method in ("adakv", "critical_adakv"):  # heads differ, each layer's total is the uniform total
        assert bool((per_head.sum(-1) == 20 * kv_heads).all())
    elif method in ARTIFACT_METHODS:  # heads and layers differ, the model's total is the uniform total
        assert int(per_head.sum()) == 20 * kv_heads * 3
    elif method in RATIO_ONLY_METHODS:  # the paper's S + (n-1)*floor(rL) + L + rem
        assert bool((per_head == kept_length(64, 4, 8, 4)).all())
    elif method in GLOBAL_TOKEN_METHODS:  # per-head counts vary, the model's total is the uniform total
        assert int(per_head.sum()) == 20 * kv_heads * 3
    elif method in GLOBAL_BLOCK_METHODS:  # KV-Compress: whole blocks of 16 across layers and heads, ⌈M·L·H/16⌉,
        protected = pipeline.params["protected_window"]  # but never below the protected window of every head
        expected = max(-(-20 * kv_heads * 3 // 16), 3 * kv_heads * -(-protected // 16))
        assert int((-(-per_head // 16)).sum()) == expected
        assert bool((per_head >= min(protected, 64)).all())
    else:
        assert bool((per_head == 20).all())
    for layer in cache.layers:
        counts = layer.store.entries_per_head()
        expected_layout = "dense" if bool((counts == counts.max()).all()) else "ragged"
        assert layer.store.layout == expected_layout
    # Bytes held are exactly the kept entries: K and V, fp32, no slack right after compression.
    key_dim = head_dim // 2 if method in CHANNEL_METHODS else head_dim  # ThinK stores thinner keys
    assert stats.kv_bytes == stats.entries * (head_dim + key_dim) * 4


def test_protected_windows_are_kept():
    model = tiny_model("qwen2", layers=2)
    ids = torch.randint(3, 200, (1, 80), generator=torch.Generator().manual_seed(3))
    cases = [
        ("snapkv", 40, range(80 - 8, 80)),
        ("streaming_llm", 24, [*range(4), 79]),
        ("h2o", 24, range(80 - 12, 80)),
        ("tova", 24, [79]),
        ("pyramidkv", 40, range(80 - 8, 80)),
    ]
    for method, budget, must_keep in cases:
        cache = KVTrimCache(2, get_method(method), BudgetSpec(budget=budget), auto_compress=False)
        with torch.inference_mode(), kvtrim_attention_enabled(model):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.compress()
        for layer in cache.layers:
            for head in range(2):
                kept = set(layer.store.positions[0, head].tolist())
                assert set(must_keep) <= kept, (method, sorted(set(must_keep) - kept))


@pytest.mark.parametrize("method", ["streaming_llm", "tova"])
def test_new_tokens_get_true_positions_after_eviction(method):
    """One layer: keys depend only on (token, position), so the compressed cache must equal a fresh run over the
    kept tokens at their original positions. A wrong position for the new token would change the logits."""
    model = tiny_model("llama", layers=1)
    t = 50
    ids = torch.randint(3, 200, (1, t), generator=torch.Generator().manual_seed(4))
    cache = KVTrimCache(1, get_method(method), BudgetSpec(budget=16), auto_compress=False)
    new = torch.tensor([[7]])
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.compress()
        kept = cache.layers[0].store.positions[0, 0]
        assert bool((cache.layers[0].store.positions == kept).all())  # one token set for every head here
        out = model(input_ids=new, past_key_values=cache, use_cache=True).logits[0, -1]  # default positions
    pos = torch.cat([kept, torch.tensor([t])])[None]
    ref_ids = torch.cat([ids[0, kept], new[0]])[None]
    with torch.inference_mode():
        ref = model(input_ids=ref_ids, position_ids=pos, past_key_values=DynamicCache()).logits[0, -1]
        wrong = model(input_ids=ref_ids, past_key_values=DynamicCache()).logits[0, -1]  # compacted positions
    assert torch.allclose(out, ref, atol=1e-4)
    assert not torch.allclose(out, wrong, atol=1e-3)


def test_left_padded_batch_equals_rows_run_alone(tokenizer):
    model = tiny_model("mistral", layers=2)
    contexts = [random_text(90, seed=5), random_text(47, seed=6)]
    batched = kvtrim.generate(
        model,
        tokenizer,
        contexts,
        ["q?", "r?"],
        method="snapkv",
        ratio=0.5,
        max_new_tokens=8,
        method_params={"window": 8},
    )
    for row, ctx in enumerate(contexts):
        alone = kvtrim.generate(
            model,
            tokenizer,
            ctx,
            ["q?", "r?"][row],
            method="snapkv",
            ratio=0.5,
            max_new_tokens=8,
            method_params={"window": 8},
        )
        assert batched.answers[row] == alone.answers
    assert batched.stats.context_tokens_per_row == [90 + 0, 47]


def test_padding_is_never_kept_over_real_tokens(tokenizer):
    model = tiny_model("llama", layers=2)
    session = kvtrim.Session(model, tokenizer, [random_text(60, 1), random_text(25, 2)], methods=["snapkv"])
    res = session.run("snapkv", budget=30, questions=["a", "b"], max_new_tokens=2)
    assert res.stats.context_tokens_per_row == [60, 25]
    cache = session.prefill.cache.clone(get_method("snapkv"), BudgetSpec(budget=30))
    cache.compress()
    counts = cache.entries_per_layer_head()
    assert bool((counts[0] == 30).all())  # long row: exactly the budget
    assert bool((counts[1] == 25).all())  # short row: all its real tokens, no padding
    for layer in cache.layers:
        assert layer.store.layout == "ragged"  # rows keep different counts: stored exactly
        for head in range(2):
            assert sorted(layer.store.row(1, head)[2].tolist()) == list(range(25))
    assert cache.stats().kv_bytes == (30 + 25) * 2 * 2 * 16 * 4 * 2  # (rows) * heads * layers * dim * fp32 * K,V


def test_generate_with_user_cache_compresses_after_prefill(llama):
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(7))
    cache = kvtrim.make_cache(llama, "snapkv", ratio=0.5, window=8)
    out = llama.generate(
        input_ids=ids, max_new_tokens=6, do_sample=False, past_key_values=cache, pad_token_id=0, eos_token_id=None
    )
    assert out.shape[1] == 66
    assert cache.last_report is not None and not cache.last_report.skipped
    assert cache.last_report.entries_after == 30 * 2 * 2
    # 5 decode tokens appended after compression (the 6th token is never fed back)
    assert cache.stats().entries == (30 + 5) * 2 * 2


def test_cache_without_kvtrim_attention_is_refused(llama):
    ids = torch.randint(3, 200, (1, 10))
    cache = KVTrimCache(2)
    with pytest.raises(kvtrim.UnsupportedModelError, match="attn_implementation='kvtrim'"):
        llama(input_ids=ids, past_key_values=cache, use_cache=True)


def test_cache_is_freed_without_the_cycle_collector(llama):
    import gc
    import weakref

    ids = torch.randint(3, 200, (1, 30))
    gc.disable()
    try:
        cache = KVTrimCache(2, get_method("snapkv", window=4), BudgetSpec(ratio=0.5), auto_compress=False)
        with torch.inference_mode(), kvtrim_attention_enabled(llama):
            llama(input_ids=ids, past_key_values=cache, use_cache=True)
            clone = cache.clone(get_method("snapkv", window=4), BudgetSpec(ratio=0.5))
        refs = [weakref.ref(cache), weakref.ref(clone)]
        del cache, clone
        assert all(r() is None for r in refs)  # freed by reference counting alone
    finally:
        gc.enable()


@pytest.mark.parametrize("method", [None, "snapkv"])
def test_chunks_continuing_an_intact_prefix_run_as_lower_right_causal_attention(monkeypatch, method):
    """The CUDA path (made to run here): a prompt chunk over a dense store nothing was evicted from is attended as
    causal attention aligned at the end; the tokens equal the position-mask path, and it stops once entries are
    evicted."""
    from kvtrim.cache import attention
    from kvtrim.integration import cache as integration_cache

    model, tok = tiny_model("llama"), byte_tokenizer()
    args = dict(method=method, prefill_chunk=48, max_new_tokens=6, **({"ratio": 0.5} if method else {}))
    want = kvtrim.generate(model, tok, random_text(300, seed=3), "q?", **args)
    calls = []
    real = attention.continued_causal_attention

    def counted(query, keys, *rest):
        calls.append((query.shape[2], keys.shape[2]))
        return real(query, keys, *rest)

    monkeypatch.setattr(integration_cache, "lower_right_causal_on", lambda device: True)
    monkeypatch.setattr(attention, "continued_causal_attention", counted)
    got = kvtrim.generate(model, tok, random_text(300, seed=3), "q?", **args)
    assert got.answers == want.answers
    layers = model.config.num_hidden_layers
    assert len(calls) % layers == 0 and all(q < s for q, s in calls)
    if method is None:  # every chunk after the first continues the prefix
        assert len(calls) // layers >= 300 // 48 - 1
    else:  # snapkv evicts after every chunk: no chunk continues an intact prefix
        assert not calls
