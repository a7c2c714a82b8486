"""AdaKV inside vLLM on the whole embedded SmolLM2 (30 layers): the transformers path's tokens."""

from __future__ import annotations

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

import torch
from vllm.inputs import TokensPrompt
from vllm_helpers import MODEL_DIR, close, make_llm, scheduler, token_prompts, used_blocks

from vllm import SamplingParams

pytestmark = pytest.mark.slow


def test_adakv_on_the_full_model_equals_the_transformers_path():
    prompt = token_prompts([700], seed=11)[0]
    config = {"method": "adakv", "budget": 128}
    llm = make_llm(config, block_size=32)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        out = list(
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0].token_ids
        )
        engine = llm.llm_engine.engine_core.engine_core
        worker = engine.model_executor.driver_worker.worker.model_runner._kvtrim_state
        assert scheduler(llm)._kvtrim_state.blocks_freed == 22 - 5  # ⌈700/32⌉ − ⌈(128 + 31)/32⌉
        assert worker.ragged_layers == 30 and used_blocks(llm) == 0
    finally:
        close(llm)
    from transformers import AutoModelForCausalLM

    import kvtrim

    hf = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    x = torch.tensor([prompt])
    reference = hf.generate(
        x, past_key_values=kvtrim.make_cache(hf, "adakv", budget=128), max_new_tokens=16, do_sample=False
    )
    vanilla = hf.generate(x, max_new_tokens=16, do_sample=False)
    assert out == reference[0, len(prompt) :].tolist()
    assert out != vanilla[0, len(prompt) :].tolist()
