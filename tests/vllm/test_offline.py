"""kvtrim's vLLM plugin through ``vllm.LLM``: exactness without eviction, freed blocks, reuse, no leaks."""

from __future__ import annotations

import random

import pytest
import vllm_helpers  # first: sets vLLM environment variables before vLLM is imported

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from vllm.inputs import TokensPrompt
from vllm_helpers import BLOCK, close, gauge, make_llm, scheduler, token_prompts, truncated_model, used_blocks

from kvtrim.vllm.config import parse_config
from vllm import SamplingParams

pytestmark = pytest.mark.slow

LENGTHS = [60, 300, 700]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _generate(llm, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS)


@pytest.fixture(scope="module")
def vanilla(prompts) -> list[list[int]]:
    llm = make_llm()
    try:
        return _generate(llm, prompts)
    finally:
        close(llm)


def test_budget_at_or_above_prompt_is_vanilla(prompts, vanilla):
    llm = make_llm({"method": "snapkv", "budget": 2048})
    try:
        assert _generate(llm, prompts) == vanilla
        assert scheduler(llm)._kvtrim_state.requests_compressed == 0
    finally:
        close(llm)


@pytest.mark.parametrize(
    "config",
    [
        {"method": "streaming_llm", "budget": 128},
        {"method": "snapkv", "budget": 200},
        {"method": "tova", "ratio": 0.75},
        {"method": "knorm", "budget": 150},
        {"method": "lagkv", "ratio": 0.5, "params": {"sink": 4, "lag": 64}},
    ],
    ids=lambda c: c["method"],
)
def test_eviction_frees_the_expected_blocks(prompts, vanilla, config):
    keep = [parse_config(config).keep_count(len(p)) for p in prompts]
    llm = make_llm(config)
    try:
        out = _generate(llm, prompts)
        state = scheduler(llm)._kvtrim_state
        # The first token comes from the prefill logits, computed before anything is evicted.
        assert [o[0] for o in out] == [v[0] for v in vanilla]
        assert all(len(o) == GREEDY.max_tokens for o in out)
        assert state.requests_compressed == sum(k < len(p) for k, p in zip(keep, prompts, strict=True))
        freed = [_cdiv(len(p), BLOCK) - _cdiv(k, BLOCK) for k, p in zip(keep, prompts, strict=True)]
        assert state.blocks_freed == sum(freed)
        assert state.dropped == {} and used_blocks(llm) == 0
    finally:
        close(llm)


def _run_until_done(llm, prompts, params, step_hook=None) -> int:
    """Feed ``prompts`` through ``LLMEngine.add_request``/``step``; returns the most requests running at once."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, int(gauge(llm, "vllm:num_requests_running")))
        if step_hook is not None:
            step_hook(engine)
    return most


def test_blocks_in_use_drop_and_freed_blocks_admit_more_requests():
    # 8 usable blocks of 128 tokens; every 400-token prompt needs 4 blocks to be admitted.
    prompts = token_prompts([400] * 6, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    config = {"method": "snapkv", "budget": 100}  # 100 kept + 24 new tokens stay in one block

    llm = make_llm(disable_log_stats=False, num_gpu_blocks_override=9, max_model_len=1024)
    try:
        llm.llm_engine.add_request("one", TokensPrompt(prompt_token_ids=prompts[0]), params)
        llm.llm_engine.step()
        vanilla_blocks = used_blocks(llm)
        llm.llm_engine.abort_request(["one"])
        llm.llm_engine.step()
        vanilla_running = _run_until_done(llm, prompts, params)
    finally:
        close(llm)

    llm = make_llm(config, disable_log_stats=False, num_gpu_blocks_override=9, max_model_len=1024)
    try:
        llm.llm_engine.add_request("one", TokensPrompt(prompt_token_ids=prompts[0]), params)
        llm.llm_engine.step()
        kvtrim_blocks = used_blocks(llm)
        usage = gauge(llm, "vllm:kv_cache_usage_perc")
        llm.llm_engine.abort_request(["one"])
        llm.llm_engine.step()
        kvtrim_running = _run_until_done(llm, prompts, params)
        assert used_blocks(llm) == 0
    finally:
        close(llm)

    assert vanilla_blocks == _cdiv(400, BLOCK) == 4
    assert kvtrim_blocks == _cdiv(100, BLOCK) == 1
    assert usage == pytest.approx(1 / 8)
    # Four requests were admitted with 4 x 4 prompt blocks, twice the pool: only reused freed blocks allow that.
    assert vanilla_running == 2
    assert kvtrim_running >= 4


LEAK_REQUESTS = 200


def _watch_kvtrim_frees(sched) -> dict[int, str]:
    """Record which block ids kvtrim's eviction returns to the pool, and from which request.

    Wraps the scheduler's (kvtrim-patched) ``_update_after_schedule`` on this instance: the blocks a request
    holds before the call and not after it are the ones eviction freed (nothing else shrinks a block list there).
    """
    freed: dict[int, str] = {}
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    inner = sched._update_after_schedule

    def _update_after_schedule(scheduler_output):
        before = {r: [b.block_id for b in blocks] for r, blocks in manager.req_to_blocks.items()}
        inner(scheduler_output)
        for r, ids in before.items():
            after = {b.block_id for b in manager.req_to_blocks.get(r, [])}
            freed.update({b: r for b in ids if b not in after})

    sched._update_after_schedule = _update_after_schedule
    return freed


def test_no_block_leaks_after_randomized_requests_with_aborts(tmp_path):
    # The 200 requests on a 2-layer cut of SmolLM2 (same heads, tokenizer and 128-token blocks): the
    # bookkeeping under test does not depend on depth, and 30 layers would make this test take ~30 minutes here.
    model = truncated_model(tmp_path / "smollm2-2layers", layers=2)
    rng = random.Random(0)
    lengths = [rng.randint(20, 900) for _ in range(LEAK_REQUESTS)]
    prompts = token_prompts(lengths, seed=2)
    budgets = [rng.choice([32, 96, 200, 1000]) for _ in range(LEAK_REQUESTS)]
    # One configuration per engine, so the randomized budgets come from random prompt lengths around four
    # budgets: each engine gets a quarter of the requests (budget 1000 keeps most prompts whole).
    total_aborted, total_compressed, total_reused = 0, 0, 0
    for budget in sorted(set(budgets)):
        chosen = [i for i, b in enumerate(budgets) if b == budget]
        config = {"method": "snapkv", "budget": budget}
        # A small pool (16 usable blocks) also forces preemptions of compressed requests.
        llm = make_llm(config, model=str(model), disable_log_stats=False, num_gpu_blocks_override=17)
        engine = llm.llm_engine
        sched = scheduler(llm)
        manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
        freed = _watch_kvtrim_frees(sched)
        reused: set[int] = set()

        def note_reuse(manager=manager, freed=freed, reused=reused):
            # A block kvtrim freed from one request, now held by another: freed blocks are reused.
            for r, blocks in manager.req_to_blocks.items():
                reused.update(b.block_id for b in blocks if freed.get(b.block_id, r) != r)

        try:
            requests = {str(i): (prompts[i], vllm_helpers.greedy(rng.randint(1, 24))) for i in chosen}
            aborted = vllm_helpers.drive(engine, requests, abort_chance=0.2, rng=rng, on_step=note_reuse)
            state, _ = vllm_helpers.assert_nothing_held(llm)
            expected = sum(parse_config(config).keep_count(lengths[i]) < lengths[i] for i in chosen)
            # Aborted requests may end before their prefill: at most that many are never compressed.
            # (each at most once: a request preempted after compression is recomputed uncompressed).
            assert expected - len(aborted) <= state.requests_compressed <= expected, (expected, len(aborted))
            total_aborted += len(aborted)
            total_compressed += state.requests_compressed
            total_reused += len(reused)
        finally:
            close(llm)
    assert total_aborted >= 10, total_aborted
    assert total_compressed > LEAK_REQUESTS // 2, total_compressed
    assert total_reused > 0, "no block that kvtrim freed was ever given to another request"
