"""Context-only compression inside vLLM: a request's ``kvtrim_context_tokens`` (``SamplingParams.extra_args``)
ends a prefill chunk there, the plugin compresses the context alone and keeps the question whole."""

from __future__ import annotations

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

import torch
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm_helpers import close, make_llm, scheduler, token_prompts, truncated_model, used_blocks, worker_state

from kvtrim.vllm.config import parse_config
from vllm import SamplingParams

pytestmark = pytest.mark.slow

LAYERS = 4
BLOCK = 32
CHUNK = 128
BUDGET = 64
KV_HEADS = 3
PROMPT, CONTEXT = 700, 600  # the context ends inside the fifth 128-token chunk: the scheduler must cut there
TOKENS = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("context") / "smollm2-4layers", layers=LAYERS)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return token_prompts([PROMPT], seed=5)[0]


def _params(context, **more) -> SamplingParams:
    extra = None if context is None else {"kvtrim_context_tokens": context, **more}
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, extra_args=extra)


def _llm(model, config):
    return make_llm(
        config, model=str(model), block_size=BLOCK, max_num_batched_tokens=CHUNK, enable_chunked_prefill=True
    )


def _context_only_reference(model, prompt: list[int], method: str) -> list[int]:
    """kvtrim's transformers path in context-only mode: prefill the context, compress it, feed the question, decode
    greedily (what ``kvtrim eval`` does for a context-only record)."""
    from transformers import AutoModelForCausalLM

    from kvtrim.compression.compressor import BudgetSpec
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.methods import get_method
    from kvtrim.runtime import Prefill, feed, greedy_decode

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    pipeline, spec = get_method(method), BudgetSpec(budget=BUDGET)
    ctx, question = torch.tensor([prompt[:CONTEXT]]), torch.tensor([prompt[CONTEXT:]])
    with torch.inference_mode(), kvtrim_attention_enabled(hf):
        pre = Prefill.plain(hf, ctx, torch.ones_like(ctx), pipeline.observation)
        cache = pre.compressed(pipeline, spec).cache
        fed = feed(hf, cache, pre.mask, question)
        return greedy_decode(hf, cache, fed.mask, fed.logits, TOKENS).tokens[0]


def _run(llm, prompt, params, steps: list[dict]) -> list[int]:
    """One request through ``add_request``/``step``; ``steps`` gets each step's scheduled tokens per request."""
    engine = llm.llm_engine
    sched = scheduler(llm)
    orig = sched._update_after_schedule

    def recording(output):
        steps.append(dict(output.num_scheduled_tokens))
        return orig(output)

    sched._update_after_schedule = recording
    try:
        engine.add_request("r", TokensPrompt(prompt_token_ids=prompt), params)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out = list(o.outputs[0].token_ids)
        return out
    finally:
        del sched._update_after_schedule


@pytest.mark.parametrize("method", ["snapkv", "adakv"])
def test_context_tokens_compress_the_context_alone_and_equal_kvtrims_context_only_path(model, prompt, method):
    config = parse_config({"method": method, "budget": BUDGET})
    llm = _llm(model, {"method": method, "budget": BUDGET})
    steps: list[dict] = []
    try:
        out = _run(llm, prompt, _params(CONTEXT), steps)
        state, worker = scheduler(llm)._kvtrim_state, worker_state(llm)
        prefill = [n for step in steps for n in step.values()][:6]  # one request (vLLM gives it its own id)
        assert prefill == [128, 128, 128, 128, 88, 100]  # cut at token 600, then the 100-token question whole
        keep = config.slot_count(CONTEXT, LAYERS, BLOCK, kv_heads=KV_HEADS)
        assert keep == (BUDGET + BLOCK - 1 if config.per_head else BUDGET)
        assert state.requests_compressed == 1 and worker.evictions == 1
        assert state.blocks_freed == _cdiv(CONTEXT, BLOCK) - _cdiv(keep, BLOCK)
        assert used_blocks(llm) == 0 and state.dropped == {}
        whole = _run(llm, prompt, _params(None), [])  # the same prompt compressed after its last token
    finally:
        close(llm)
    assert out == _context_only_reference(model, prompt, method)
    assert out != whole  # scoring without the question kept other entries: the match says something


def test_bad_context_tokens_and_rounds_are_refused_and_the_engine_goes_on(model, prompt):
    llm = _llm(model, {"method": "snapkv", "budget": BUDGET})
    try:
        for bad in (0, PROMPT + 1, "600"):
            with pytest.raises(VLLMValidationError, match=r"context_tokens'\] must be an integer in \[1, prompt"):
                _run(llm, prompt, _params(bad), [])
        with pytest.raises(VLLMValidationError, match=r"unknown kvtrim settings \['kvtrim_budget'\]"):
            _run(llm, prompt, _params(CONTEXT, kvtrim_budget=8), [])
        assert used_blocks(llm) == 0 and not scheduler(llm).requests  # nothing of the refused requests is held
        assert len(_run(llm, prompt, _params(CONTEXT), [])) == TOKENS
    finally:
        close(llm)
    rounds = _llm(model, {"method": "snapkv", "budget": BUDGET, "between_chunks": True})
    try:
        with pytest.raises(VLLMValidationError, match="compresses in rounds"):
            _run(rounds, prompt, _params(CONTEXT), [])
        assert len(_run(rounds, prompt, _params(None), [])) == TOKENS
    finally:
        close(rounds)
