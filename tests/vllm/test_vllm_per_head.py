"""Per-head budgets inside vLLM: one-head sub-pages under a uniform block list, folded attention (AdaKV)."""

from __future__ import annotations

import random

import pytest
import vllm_helpers  # first: sets vLLM environment variables before vLLM is imported

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from per_head_checks import (
    BLOCK,
    BUDGET,
    LAYERS,
    LENGTHS,
    check_sub_pages,
    check_tokens_and_blocks,
    generate,
    transformers_tokens,
    worker_state,
)
from vllm_helpers import close, make_llm, scheduler, token_prompts, truncated_model, used_blocks

from kvtrim.vllm.config import parse_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("heads") / "smollm2-4layers", layers=LAYERS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS)


def test_adakv_tokens_equal_the_transformers_path_and_heads_keep_different_counts(model, prompts):
    check_tokens_and_blocks(model, prompts, "adakv")


def test_adakv_in_whole_pages_frees_what_snapkv_frees(model, prompts):
    """``params.page_size`` equal to vLLM's block size (32): each layer's heads share ⌈64·3/32⌉ = 6 one-head pages,
    so a request keeps 2 blocks, SnapKV's count at B = 64 (no block − 1 of slack), through 24 decoded tokens; the
    tokens equal the transformers path with the same parameters and differ from AdaKV's per-entry counts."""
    check_tokens_and_blocks(model, prompts, "adakv", {"page_size": BLOCK}, min_ragged=2, slots=BUDGET)


def test_adakv_prompt_within_one_block_of_the_budget_splits_heads_without_freeing_blocks(model):
    """B < prompt <= B + block − 1: the request keeps its blocks, its heads still keep their own counts."""
    prompt = token_prompts([80], seed=9)[0]
    assert parse_config({"method": "adakv", "budget": BUDGET}).slot_count(80, LAYERS, BLOCK) == 80
    llm = make_llm({"method": "adakv", "budget": BUDGET}, model=str(model), block_size=BLOCK)
    try:
        out = generate(llm, [prompt], 24)
        state = scheduler(llm)._kvtrim_state
        worker = worker_state(llm)
        assert state.blocks_freed == 0 and state.requests_compressed == 0  # the scheduler frees nothing
        assert worker.evictions == 1 and worker.ragged_layers == LAYERS
        assert used_blocks(llm) == 0
    finally:
        close(llm)
    assert out == transformers_tokens(model, [prompt], "adakv", 24)


def test_adakv_sub_pages_hold_their_invariants_and_nothing_leaks_with_aborts(model, monkeypatch):
    """12 requests on a 24-block pool (queueing, preemption), aborts, sub-page invariants checked every step."""
    checked = check_sub_pages(monkeypatch)
    rng = random.Random(7)
    lengths = [rng.randint(100, 650) for _ in range(12)]
    prompts = token_prompts(lengths, seed=8)
    config = {"method": "adakv", "budget": BUDGET}
    # 24 usable blocks of 32 tokens: 768 tokens, one request of the longest prompt and output at a time
    llm = make_llm(config, model=str(model), block_size=BLOCK, num_gpu_blocks_override=25, max_model_len=768)
    try:
        requests = {str(i): (p, vllm_helpers.greedy(rng.randint(1, 70))) for i, p in enumerate(prompts)}
        vllm_helpers.drive(llm.llm_engine, requests, abort_at={4: ["4", "5"], 9: ["9", "10"]})
        state, _ = vllm_helpers.assert_nothing_held(llm, "heads")
        assert state.requests_compressed >= 8 and max(checked) >= 2  # several per-head requests decoded together
    finally:
        close(llm)


def test_a_per_head_method_without_the_folding_backend_refuses_to_start(model, monkeypatch):
    """What a GPU (or a backend override by someone else) looks like to the start-up check."""
    from vllm.v1.attention.backends import registry

    from kvtrim.vllm import plugin
    from kvtrim.vllm.wrappers import UnpatchedVLLMError

    monkeypatch.setattr(plugin, "_register_head_backend", lambda: None)
    monkeypatch.delitem(registry._ATTN_OVERRIDES, registry.AttentionBackendEnum.CPU_ATTN, raising=False)
    with pytest.raises(UnpatchedVLLMError, match="adakv keeps a different count per KV head"):
        make_llm({"method": "adakv", "budget": BUDGET}, model=str(model), block_size=BLOCK)
