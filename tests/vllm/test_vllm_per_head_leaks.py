"""Per-head budgets inside vLLM: 200 randomized requests with aborts leave no block, sub-page or state behind."""

from __future__ import annotations

import random

import pytest
import vllm_helpers  # first: sets vLLM environment variables before vLLM is imported

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from per_head_checks import check_sub_pages
from vllm_helpers import close, gauge, make_llm, scheduler, token_prompts, truncated_model

pytestmark = pytest.mark.slow

REQUESTS = 200
BLOCK = 32
LAYERS = 2  # the bookkeeping under test does not depend on depth
POOL = 20  # usable blocks of 32 tokens: 640 tokens, one long prefill at a time: queueing and preemption
# One configuration per engine; a ratio makes each request's budget follow its random prompt length. Prompts
# under ``min_prompt`` keep every entry: the 8-token request that delivers the last aborts is never compressed
# (it finishes last, so the worker would only hear of it with a later step).
CONFIGS = [
    {"method": "adakv", "budget": 48},
    {"method": "adakv", "ratio": 0.7, "min_prompt": 16},
    {"method": "critical_adakv", "budget": 100},
    {"method": "critical_adakv", "ratio": 0.4, "min_prompt": 16},
]


def test_per_head_requests_with_aborts_return_every_block_and_sub_page(tmp_path, monkeypatch):
    checked = check_sub_pages(monkeypatch)
    model = truncated_model(tmp_path / "smollm2-2layers", layers=LAYERS)
    rng = random.Random(11)
    lengths = [rng.randint(20, 320) for _ in range(REQUESTS)]
    prompts = token_prompts(lengths, seed=12)
    engines = [rng.randrange(len(CONFIGS)) for _ in range(REQUESTS)]
    total_aborted, total_compressed, total_preempted = 0, 0, 0
    for e, config in enumerate(CONFIGS):
        chosen = [i for i, k in enumerate(engines) if k == e]
        llm = make_llm(
            config,
            model=str(model),
            block_size=BLOCK,
            num_gpu_blocks_override=POOL + 1,
            max_model_len=POOL * BLOCK,
            disable_log_stats=False,
        )
        engine = llm.llm_engine
        sched = scheduler(llm)
        pool = sched.kv_cache_manager.block_pool
        free_at_start = pool.get_num_free_blocks()
        try:
            requests = {str(i): (prompts[i], vllm_helpers.greedy(rng.randint(1, 24))) for i in chosen}
            aborted = vllm_helpers.drive(engine, requests, abort_chance=0.08, rng=rng)
            state, worker = vllm_helpers.assert_nothing_held(llm, "heads")  # no request's sub-pages outlive it
            assert pool.get_num_free_blocks() == free_at_start, (config, free_at_start, pool.get_num_free_blocks())
            assert worker.evictions >= state.requests_compressed > 0
            total_aborted += len(aborted)
            total_compressed += state.requests_compressed
            total_preempted += int(gauge(llm, "vllm:num_preemptions"))
        finally:
            close(llm)
    print(f"aborted {total_aborted}, compressed {total_compressed}, preempted {total_preempted}")
    assert total_aborted >= 10, total_aborted
    assert total_preempted > 0, "no request was preempted: the pool is too large to test preemption"
    assert total_compressed > REQUESTS // 2, total_compressed
    assert max(checked) >= 2  # several per-head requests decoded in one folded step
