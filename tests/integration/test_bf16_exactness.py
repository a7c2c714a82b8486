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


def _teacher_forced_logits(model, ids, continuation, cache) -> list[torch.Tensor]:
    """Logits ``[1, vocab]`` after the prompt and after each token of ``continuation``, fed one at a time."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for step in range(continuation.shape[1] - 1):
            pos = torch.tensor([[ids.shape[1] + step]])
            out = model(input_ids=continuation[:, step : step + 1], past_key_values=cache, use_cache=True,
                        position_ids=pos)
            logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("method", ["full", "snapkv", "h2o"])
def test_bf16_kvtrim_without_eviction_matches_hf(bf16_model, prompt_and_reference, method):
    """Teacher-forced on HF's own greedy continuation, so one rounding tie cannot fork the two sequences.

    HF's SDPA path arranges the GQA decode call differently across transformers versions (5.16 repeats the KV
    heads, 5.23 packs the query group), and in bf16 that alone can flip a near-tie between two tokens. So the greedy
    token must match wherever HF's top-2 margin is larger than bf16's rounding; the logits must match everywhere."""
    model, _ = bf16_model
    ids, ref = prompt_and_reference
    params = {} if method == "full" else {"budget": 1000}  # a budget above the context: nothing is evicted
    continuation = ref.sequences[:, ids.shape[1] :]
    with kvtrim.compressing(model, method, **params) as cache:
        got = _teacher_forced_logits(model, ids, continuation, cache)
    assert cache.kv_layers[0].store.keys.dtype == torch.bfloat16  # the cache really holds bf16
    if method != "full":
        assert cache.last_report is not None and cache.last_report.skipped
    decided = 0
    for step, (a, b) in enumerate(zip(got, ref.logits, strict=True)):
        # bf16 has 8 significant bits: logits of magnitude ~20 round in steps of 0.125; two attention kernels
        # summing in different orders may differ by a few such steps
        torch.testing.assert_close(a.float(), b.float(), atol=0.5, rtol=0.02, msg=f"{method} step {step}")
        top2 = b.float().topk(2, dim=-1).values
        if float(top2[0, 0] - top2[0, 1]) > 0.5:  # a clear winner (beyond the logits tolerance): the same token
            decided += 1
            assert int(a.argmax(-1)) == int(continuation[0, step]), f"{method} step {step}"
    assert decided >= NEW_TOKENS // 4  # the check above is not vacuous on this prompt
