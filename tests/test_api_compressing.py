"""`with kvtrim.compressing(model): model.generate(...)` without a cache compresses; misuse gets kvtrim errors."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvtrim
from conftest import random_text
from kvtrim.errors import InvalidParameterError, KVTrimError

CTX = random_text(150, seed=3)


@pytest.fixture
def inputs(tokenizer):
    ids = tokenizer(CTX, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_generate_without_a_cache_compresses(llama, inputs):
    with kvtrim.compressing(llama, "snapkv", ratio=0.5) as cache:
        implicit = llama.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert cache.compressions == 1 and cache.last_report is not None
    assert cache.stats().entries < cache.layers[0].seen * llama.config.num_key_value_heads * 2  # evicted for real
    with kvtrim.compressing(llama, "snapkv", ratio=0.5) as explicit_cache:
        explicit = llama.generate(**inputs, past_key_values=explicit_cache, max_new_tokens=6, do_sample=False)
    assert torch.equal(implicit, explicit)
    assert "generate" not in llama.__dict__  # restored on exit
    assert llama.config._attn_implementation != "kvtrim"


def test_every_call_without_a_cache_gets_a_fresh_compressing_cache(llama, inputs):
    with kvtrim.compressing(llama, "snapkv", ratio=0.5) as cache:
        first = llama.generate(**inputs, max_new_tokens=4, do_sample=False)
        second = llama.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(first, second)
    assert cache.compressions == 1  # the yielded cache served the first call only


def test_compressing_differs_from_the_full_cache(llama, inputs):
    full = llama.generate(**inputs, max_new_tokens=8, do_sample=False)
    with kvtrim.compressing(llama, "streaming_llm", ratio=0.9):
        trimmed = llama.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert not torch.equal(full, trimmed)  # the compression changes what the model sees


def test_another_cache_type_inside_compressing_raises(llama, inputs):
    with kvtrim.compressing(llama, "snapkv", ratio=0.5), pytest.raises(InvalidParameterError, match="DynamicCache"):
        llama.generate(**inputs, past_key_values=DynamicCache(), max_new_tokens=2)


def test_a_transformers_quantized_cache_is_refused_naming_kv_quant(llama, inputs):
    """kvtrim holds quantized entries itself; a transformers QuantizedCache (given, or asked for by name) would
    replace kvtrim's cache and compress nothing. Built without its backend (quanto / HQQ are not installed): only
    its type is read before the refusal."""
    from transformers.cache_utils import QuantizedCache

    given = QuantizedCache.__new__(QuantizedCache)
    with kvtrim.compressing(llama, "snapkv", ratio=0.5):
        with pytest.raises(InvalidParameterError, match=r"QuantizedCache; .*kv_quant='int8', 'int4' or 'fp8'"):
            llama.generate(**inputs, past_key_values=given, max_new_tokens=2)
        with pytest.raises(InvalidParameterError, match=r"cache_implementation='quantized'.*kv_quant="):
            llama.generate(**inputs, cache_implementation="quantized", max_new_tokens=2)
        with pytest.raises(InvalidParameterError, match=r"cache_implementation='static'.*leave it unset"):
            llama.generate(**inputs, cache_implementation="static", max_new_tokens=2)
        out = llama.generate(**inputs, max_new_tokens=2, do_sample=False)  # nothing was changed by the refusals
    assert out.shape[1] == inputs["input_ids"].shape[1] + 2


def test_a_real_transformers_quantized_cache_is_refused_with_its_nearest_kv_quant(llama, inputs):
    """transformers' own fp8 backend (no extra package; transformers >= 5.23) builds a real QuantizedCache, which
    generates on its own and is refused inside kvtrim.compressing, naming kvtrim's nearest setting."""
    from transformers import cache_utils

    if not hasattr(cache_utils, "Fp8QuantizedLayer"):
        pytest.skip("this transformers has no fp8 QuantizedCache backend (added in 5.23)")
    fp8 = cache_utils.QuantizedCache(backend="fp8", config=llama.config)
    out = llama.generate(**inputs, past_key_values=fp8, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 2  # the backend works here
    given = cache_utils.QuantizedCache(backend="fp8", config=llama.config)
    with kvtrim.compressing(llama, "snapkv", ratio=0.5):
        with pytest.raises(InvalidParameterError, match=r"QuantizedCache; .*nearest to this cache is kv_quant='fp8'"):
            llama.generate(**inputs, past_key_values=given, max_new_tokens=2)
        with pytest.raises(InvalidParameterError, match=r"nearest to this cache is kv_quant='int4:residual=64'"):
            llama.generate(
                **inputs,
                cache_implementation="quantized",
                cache_config={"backend": "quanto", "nbits": 4, "residual_length": 64},
                max_new_tokens=2,
            )
        for residual, spec in ((0, "int4:residual=0"), (32, "int4")):  # int4's own default window is 32
            with pytest.raises(InvalidParameterError, match=rf"nearest to this cache is kv_quant='{spec}'"):
                llama.generate(
                    **inputs,
                    cache_implementation="quantized",
                    cache_config={"backend": "quanto", "nbits": 4, "residual_length": residual},
                    max_new_tokens=2,
                )
        with pytest.raises(InvalidParameterError, match=r"no 2-bit entries"):
            llama.generate(**inputs, cache_implementation="quantized", cache_config={"nbits": 2}, max_new_tokens=2)


def test_reusing_a_cache_raises_a_kvtrim_error(llama, inputs):
    with kvtrim.compressing(llama, "snapkv", ratio=0.5) as cache:
        llama.generate(**inputs, past_key_values=cache, max_new_tokens=3)
        with pytest.raises(InvalidParameterError, match="serves one generate call"):
            llama.generate(**inputs, past_key_values=cache, max_new_tokens=3)
    cache = kvtrim.make_cache(llama, "snapkv", ratio=0.5)
    llama.generate(**inputs, past_key_values=cache, max_new_tokens=3)
    with pytest.raises(InvalidParameterError, match="serves one generate call"):
        llama.generate(**inputs, past_key_values=cache, max_new_tokens=3)


def test_wrong_attention_message_names_real_constructors(llama, inputs):
    cache = kvtrim.KVTrimCache(llama.config.num_hidden_layers)
    with pytest.raises(KVTrimError, match=r"kvtrim\.compressing\(model, \.\.\.\) or kvtrim\.make_cache") as info:
        llama(**inputs, past_key_values=cache)
        llama(**inputs, past_key_values=cache)
    assert "KVTrimCache(model" not in str(info.value)


def test_bad_method_params_are_kvtrim_errors(llama, tokenizer):
    with pytest.raises(InvalidParameterError, match=r"'window': 0.*snapkv.*window must be positive"):
        kvtrim.generate(llama, tokenizer, CTX, "q?", ratio=0.5, method_params={"window": 0})
    with pytest.raises(InvalidParameterError, match="window must be positive"):
        kvtrim.compressing(llama, "snapkv", ratio=0.5, window=0).__enter__()


def test_context_longer_than_the_model_raises(llama, tokenizer):
    limit = llama.config.max_position_embeddings
    with pytest.raises(InvalidParameterError, match=f"longer than the model's max_position_embeddings={limit}"):
        kvtrim.generate(llama, tokenizer, "x" * (limit + 1), "q?", ratio=0.5)
    with pytest.raises(InvalidParameterError, match="max_position_embeddings"):
        kvtrim.generate(llama, tokenizer, "x" * (limit - 3), "a longer question", method="full")
