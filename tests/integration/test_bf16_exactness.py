"""bf16 on the CPU with the real embedded SmolLM2: with nothing evicted, kvtrim decodes as HF's plain generate."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from kvtrim.eval.haystacks import get_haystack

pytestmark = pytest.mark.slow

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def bf16_model():
    model, tokenizer = kvtrim.load_model("smollm2-135m")  # a private copy: the session fixture stays fp32
    return model.to(torch.bfloat16).eval(), tokenizer


@pytest.fixture(scope="module")
def prompt_and_reference(bf16_model):
    model, tokenizer = bf16_model
    ids = tokenizer(get_haystack("jargon")[:3000], return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids[:, :400]
    return ids, _generate(model, ids)


def _generate(model, ids, cache=None):
    return model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        past_key_values=cache,
    )


@pytest.mark.parametrize("method", ["full", "snapkv", "h2o"])
def test_bf16_kvtrim_without_eviction_matches_hf(bf16_model, prompt_and_reference, method):
    model, _ = bf16_model
    ids, ref = prompt_and_reference
    params = {} if method == "full" else {"budget": 1000}  # a budget above the context: nothing is evicted
    with kvtrim.compressing(model, method, **params) as cache:
        got = _generate(model, ids, cache)
    assert cache.kv_layers[0].store.keys.dtype == torch.bfloat16  # the cache really holds bf16
    assert torch.equal(got.sequences, ref.sequences), method  # the same greedy tokens
    for step, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
        # bf16 has 8 significant bits: logits of magnitude ~20 round in steps of 0.125; two attention kernels
        # summing in different orders may differ by a few such steps
        torch.testing.assert_close(a.float(), b.float(), atol=0.5, rtol=0.02, msg=f"{method} step {step}")
    if method != "full":
        assert cache.last_report is not None and cache.last_report.skipped
