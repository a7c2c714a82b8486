"""Tensor parallelism on vLLM's CPU backend: each rank compacts its own KV heads; per-head methods are refused."""

from __future__ import annotations

import os

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from vllm.inputs import TokensPrompt
from vllm_helpers import close, head_sliced_model, make_llm, scheduler, token_prompts, used_blocks

from kvtrim.errors import InvalidParameterError
from kvtrim.vllm.runner_check import worker_stats
from vllm import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two CPU cores"),
]

LAYERS = 2
KV_HEADS = 2  # one per rank at tensor_parallel_size=2 (SmolLM2's 3 do not divide by 2)
BLOCK = 32
BUDGET = 64
LENGTHS = [60, 300, 700]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return head_sliced_model(tmp_path_factory.mktemp("tp") / "smollm2-2kv", layers=LAYERS, kv_heads=KV_HEADS)


def _llm(config, model, tp: int, monkeypatch):
    if tp > 1:
        # vLLM's CPU workers: one OpenMP thread group per rank, ranks talk through gloo (CpuPlatform.dist_backend)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in range(tp)))
    return make_llm(config, model=str(model), block_size=BLOCK, tensor_parallel_size=tp)


def _generate(llm) -> list[list[int]]:
    prompts = [TokensPrompt(prompt_token_ids=p) for p in token_prompts(LENGTHS)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_snapkv_at_two_ranks_keeps_the_single_rank_tokens_and_blocks(model, monkeypatch):
    """SnapKV selects per KV head: rank r scoring its own head r must select what one rank selects for it."""
    config = {"method": "snapkv", "budget": BUDGET}
    llm = _llm(None, model, 1, monkeypatch)
    try:
        vanilla = _generate(llm)
    finally:
        close(llm)
    llm = _llm(config, model, 1, monkeypatch)
    try:
        single = _generate(llm)
    finally:
        close(llm)
    llm = _llm(config, model, 2, monkeypatch)
    try:
        two = _generate(llm)
        state = scheduler(llm)._kvtrim_state
        stats = llm.collective_rpc(worker_stats)
        # One block table for both ranks: the scheduler freed the uniform count once.
        freed = sum(_cdiv(n, BLOCK) - _cdiv(BUDGET, BLOCK) for n in LENGTHS if n > BUDGET)
        assert state.requests_compressed == 2 and state.blocks_freed == freed
        assert used_blocks(llm) == 0
    finally:
        close(llm)
    assert len(stats) == 2
    for s in stats:  # each rank holds one KV head and compacted both long prompts in every layer
        assert s["kv_heads"] == 1 and s["requests_compressed"] == 2 and s["layer_evictions"] == 2 * LAYERS
    assert two == single
    assert single != vanilla  # compression changed the tokens: the equality says something


def test_a_per_head_method_refuses_two_ranks(model, monkeypatch):
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size=2 is not supported with adakv") as refused:
        _llm({"method": "adakv", "budget": BUDGET}, model, 2, monkeypatch)
    # The refused engine's executor is only shut down at interpreter exit (vLLM's finalizer holds it): end its
    # worker processes now, from the engine core found in the traceback.
    tb = refused.tb
    while tb is not None:
        executor = getattr(tb.tb_frame.f_locals.get("self"), "model_executor", None)
        if executor is not None:
            executor.shutdown()
            break
        tb = tb.tb_next
    assert executor is not None, "the refused engine core was not in the traceback"
