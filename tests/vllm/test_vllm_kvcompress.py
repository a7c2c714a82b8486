"""KV-Compress inside vLLM with ``even_layer_evict``: each layer's blocks ranked on their own, heads in sub-pages."""

from __future__ import annotations

import random

import pytest
import vllm_helpers  # first: sets vLLM environment variables before vLLM is imported

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from per_head_checks import BLOCK, BUDGET, LAYERS, LENGTHS, check_sub_pages, check_tokens_and_blocks
from vllm_helpers import close, make_llm, token_prompts, truncated_model

from kvtrim.vllm.config import parse_config

pytestmark = pytest.mark.slow

EVEN = {"even_layer_evict": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("kvc") / "smollm2-4layers", layers=LAYERS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS)


def test_budget_and_protected_window_give_adakvs_slots():
    """B = 64 over 3 KV heads, blocks of 16: ⌈64·3/16⌉ = 12 blocks = 192 entries per layer, 64 per head on average,
    above the protected window (32): the block list keeps B + 32 − 1 slots, as AdaKV's."""
    config = parse_config({"method": "kvcompress", "budget": BUDGET, "params": EVEN})
    assert config.layer_total(700, 3) == 3 * BUDGET and config.slot_count(700, LAYERS, 32, kv_heads=3) == 95


@pytest.mark.parametrize("method", ["kvcompress", "kvc_w8", "kvc_full"])
def test_even_layer_kv_compress_tokens_equal_the_transformers_path(model, prompts, method, monkeypatch):
    """Greedy tokens equal ``kvtrim.make_cache(hf, method, budget=64, even_layer_evict=True)``; every layer of both
    compressed requests holds ⌈64·3/16⌉ = 12 of KV-Compress's 16-entry blocks, split unevenly among its heads in
    most layers (whole blocks may split a layer evenly: 6 and 7 of the 8 (request, layer) pairs here)."""
    from kvtrim.vllm import worker_patch

    counts: list[list[int]] = []
    evict = worker_patch.evict_layer_heads

    def recording(*args, **kwargs):
        counts.append(evict(*args, **kwargs))
        return counts[-1]

    monkeypatch.setattr(worker_patch, "evict_layer_heads", recording)
    check_tokens_and_blocks(model, prompts, method, EVEN, min_ragged=LAYERS + 2)
    assert len(counts) == 2 * LAYERS
    assert [sum(-(-c // 16) for c in layer) for layer in counts] == [-(-BUDGET * 3 // 16)] * (2 * LAYERS)


def test_kv_compress_on_vllms_blocks_frees_what_snapkv_frees(model, prompts):
    """``params.block_size`` equal to vLLM's (32): each layer keeps ⌈64·3/32⌉ = 6 one-head pages, so a request keeps
    2 blocks, SnapKV's count at B = 64 (no block − 1 of slack), through 24 decoded tokens; tokens equal the
    transformers path with the same parameters."""
    check_tokens_and_blocks(model, prompts, "kvcompress", {**EVEN, "block_size": BLOCK}, min_ragged=2, slots=BUDGET)


def test_sub_pages_hold_and_nothing_leaks_with_aborts_and_budgets_under_the_protected_window(model, monkeypatch):
    """12 requests on a 24-block pool (queueing, preemption), aborts, sub-page invariants checked every step. A
    ratio of 0.9 gives the shorter prompts a mean budget under the protected window (32): their layers keep the
    window's whole blocks (``GlobalBlockBudget.layer_bound``), which the slots were sized for."""
    checked = check_sub_pages(monkeypatch)
    rng = random.Random(7)
    lengths = [rng.randint(100, 650) for _ in range(12)]
    prompts = token_prompts(lengths, seed=8)
    # min_prompt: the 8-token request that delivers the last aborts finishes last and is never compressed
    config = {"method": "kvcompress", "ratio": 0.9, "params": EVEN, "min_prompt": 16}
    assert parse_config(config).layer_total(100, 3) == 3 * 32  # M = 10 < 32: the window's 2 blocks per head
    llm = make_llm(config, model=str(model), block_size=BLOCK, num_gpu_blocks_override=25, max_model_len=768)
    try:
        requests = {str(i): (p, vllm_helpers.greedy(rng.randint(1, 70))) for i, p in enumerate(prompts)}
        vllm_helpers.drive(llm.llm_engine, requests, abort_at={4: ["4", "5"], 9: ["9", "10"]})
        state, _ = vllm_helpers.assert_nothing_held(llm, "heads")
        assert state.requests_compressed >= 8 and max(checked) >= 2  # several per-head requests decoded together
    finally:
        close(llm)


@pytest.mark.parametrize(
    ("base", "kvc_block"), [("kvcompress", 16), ("kvcompress", BLOCK), ("kvc_full", 16)],
    ids=["own-blocks", "vllm-blocks", "kvc_full"],
)
def test_decoding_time_metric_every_n_tokens_equals_the_transformers_path(model, base, kvc_block, monkeypatch):
    """``kvcompress@every:16`` (and ``kvc_full``, whose prefill metric reads every prompt query): compressed after the
    prompt, then at 16 and 32 decoded tokens, each round ranking the kept entries' running metric (prefill metric
    plus every decoded query's squared attention) and the tokens since; 40 greedy tokens equal
    ``kvtrim.make_cache(hf, "kvcompress@every:16", ...)``, whose cache adds
    each decoded query's squared attention step by step, and differ from compressing once. Blocks go back to the
    pool at each round."""
    from per_head_checks import generate, transformers_tokens, worker_state
    from vllm_helpers import scheduler

    checked = check_sub_pages(monkeypatch)
    params = {**EVEN, "block_size": kvc_block}
    method, tokens = f"{base}@every:16", 40
    lengths = [300, 700]
    prompts = token_prompts(lengths, seed=5)
    llm = make_llm({"method": method, "budget": BUDGET, "params": params}, model=str(model), block_size=BLOCK)
    try:
        out = generate(llm, prompts, tokens)
        state, stats = scheduler(llm)._kvtrim_state, worker_state(llm)
        metrics = {r: len(m) for r, m in stats.head_metrics.items()}  # finished requests go at the next step
        positions = {r: len(p) for r, p in stats.head_positions.items()}
        # only the queries since the last round are recorded (the 7 decoded after it), not the prompt's or older ones
        recorded = {len(rows) for layers in stats.recent.values() for rows in layers.values()}
        assert vllm_helpers.used_blocks(llm) == 0
    finally:
        close(llm)
    # after each prompt and at 16 and 32 decoded tokens (39 decoded tokens enter the cache)
    assert state.rounds == stats.rounds == 3 * len(prompts) and state.requests_compressed == len(prompts)
    assert stats.ragged_layers > 0 and len(checked) > 0
    assert metrics == positions and set(metrics.values()) == {LAYERS}  # a running metric for every kept entry
    assert recorded == {tokens - 1 - 32}
    assert out == transformers_tokens(model, prompts, method, tokens, params)
    assert out != transformers_tokens(model, prompts, base, tokens, params)  # the rounds mattered


def test_decoding_time_metric_leaks_nothing_with_preemption_and_aborts(model, monkeypatch):
    """12 requests with ``kvcompress@every:16`` on a 25-block pool (queued behind whole prompts), aborts: every
    request's positions, running metrics, recorded queries and sub-pages are gone at the end."""
    checked = check_sub_pages(monkeypatch)
    rng = random.Random(3)
    prompts = token_prompts([rng.randint(100, 600) for _ in range(12)], seed=9)
    config = {"method": "kvcompress@every:16", "budget": BUDGET, "params": EVEN, "min_prompt": 16}
    llm = make_llm(config, model=str(model), block_size=BLOCK, num_gpu_blocks_override=25, max_model_len=768)
    try:
        requests = {str(i): (p, vllm_helpers.greedy(rng.randint(1, 90))) for i, p in enumerate(prompts)}
        vllm_helpers.drive(llm.llm_engine, requests, abort_at={4: ["4", "5"], 9: ["9", "10"]})
        state, worker = vllm_helpers.assert_nothing_held(llm, "heads", "head_positions", "head_metrics", "recent")
        assert state.rounds == worker.rounds > len(prompts) and max(checked) >= 2
    finally:
        close(llm)
