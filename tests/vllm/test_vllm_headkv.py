"""HeadKV and DuoAttention inside vLLM: per-head counts fixed by a calibration artifact, blocks sized by the
largest layer."""

from __future__ import annotations

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

import torch
from per_head_checks import worker_state
from vllm.inputs import TokensPrompt
from vllm_helpers import MODEL_DIR, close, make_llm, scheduler, token_prompts, used_blocks

from kvtrim.vllm.config import parse_config
from vllm import SamplingParams

pytestmark = pytest.mark.slow

LAYERS, KV_HEADS, BLOCK, BUDGET = 30, 3, 32, 128  # the whole embedded SmolLM2: its headkv artifact is shipped


@pytest.mark.parametrize("method", ["headkv", "critical_headkv", "duo_attention"])
def test_artifact_per_head_methods_on_the_full_model_equal_the_transformers_path(method):
    prompt = token_prompts([500], seed=13)[0]
    config = parse_config({"method": method, "budget": BUDGET})
    # The artifact is found from the checkpoint's own weights (kvtrim.vllm.checkpoint_model), as vLLM's processes do.
    counts = config.head_counts(config.bound_pipeline(str(MODEL_DIR)), len(prompt), LAYERS, KV_HEADS)
    assert counts.sum(-1).max() > KV_HEADS * BUDGET and len(set(counts.flatten().tolist())) > 1
    slots = config.slot_count(len(prompt), LAYERS, BLOCK, counts)
    assert slots == min(-(-int(counts.sum(-1).max()) // KV_HEADS) + BLOCK - 1, len(prompt))
    llm = make_llm({"method": method, "budget": BUDGET}, block_size=BLOCK)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        out = list(
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0].token_ids
        )
        # blocks sized by the largest layer's mean count per head (fewer freed than AdaKV at the same budget)
        assert scheduler(llm)._kvtrim_state.blocks_freed == -(-len(prompt) // BLOCK) - -(-slots // BLOCK)
        assert worker_state(llm).ragged_layers > 0 and used_blocks(llm) == 0
    finally:
        close(llm)
    from transformers import AutoModelForCausalLM

    import kvtrim

    hf = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    x = torch.tensor([prompt])
    cache = kvtrim.make_cache(hf, method, budget=BUDGET)
    reference = hf.generate(x, past_key_values=cache, max_new_tokens=12, do_sample=False)
    vanilla = hf.generate(x, max_new_tokens=12, do_sample=False)
    assert out == reference[0, len(prompt) :].tolist()
    assert out != vanilla[0, len(prompt) :].tolist()


@pytest.mark.parametrize("method", ["headkv", "critical_headkv@every:16"])
def test_headkv_rounds_between_chunks_equal_kvtrims_chunked_path(method, monkeypatch):
    """HeadKV after every 128-token chunk (and every 16 decoded tokens): the artifact's counts at each length fix
    every head's share; the request keeps the largest layer's mean + block − 1 slots, as after prefill."""
    from per_head_checks import check_sub_pages
    from transformers import AutoModelForCausalLM

    from kvtrim.compression.compressor import BudgetSpec
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.methods import get_method
    from kvtrim.runtime import Prefill, greedy_decode

    checked = check_sub_pages(monkeypatch)
    prompt, chunk, tokens = token_prompts([600], seed=14)[0], 128, 40
    config = {"method": method, "budget": BUDGET, "between_chunks": True}
    llm = make_llm(config, block_size=BLOCK, max_num_batched_tokens=chunk, enable_chunked_prefill=True)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        out = list(
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0].token_ids
        )
        state, stats = scheduler(llm)._kvtrim_state, worker_state(llm)
        assert used_blocks(llm) == 0 and stats.ragged_layers > 0 and len(checked) > 0
    finally:
        close(llm)
    rounds = 4 + (2 if "every" in method else 0)  # chunks 2–5 exceed the budget (the first holds 128 tokens)
    assert state.rounds == stats.rounds == rounds and state.requests_compressed == 1
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    pipeline, spec = get_method(method).bind(hf), BudgetSpec(budget=BUDGET)
    x = torch.tensor([prompt])
    with torch.inference_mode(), kvtrim_attention_enabled(hf):
        pre = Prefill.chunked(hf, x, torch.ones_like(x), chunk, pipeline, spec)
        reference = greedy_decode(hf, pre.compressed(pipeline, spec).cache, pre.mask, pre.logits, tokens).tokens[0]
    assert out == reference
