"""Tensor parallelism on vLLM's CPU backend: each rank compacts its own KV heads; per-head methods whose counts
come from an artifact take their rank's heads' counts; those split by score split within groups of heads a rank
holds whole (``params.head_groups``), and are refused otherwise."""

from __future__ import annotations

import os

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from per_head_checks import transformers_tokens
from vllm.inputs import TokensPrompt
from vllm_helpers import MODEL_DIR, close, head_sliced_model, make_llm, scheduler, token_prompts, used_blocks

from kvtrim.artifacts.kinds import DUO_KIND, HEADKV_KIND
from kvtrim.artifacts.store import load_artifact, save_artifact
from kvtrim.errors import InvalidParameterError
from kvtrim.vllm.checkpoint_model import checkpoint_stand_in
from kvtrim.vllm.config import parse_config
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


@pytest.fixture(scope="module")
def four_head_model(tmp_path_factory):
    """4 KV heads (SmolLM2's heads 0, 1, 2 and 1 again, trained weights): two per rank at tensor_parallel_size=2,
    so a rank's heads have a split of their own to make."""
    path = tmp_path_factory.mktemp("tp4") / "smollm2-4kv"
    return head_sliced_model(path, layers=LAYERS, heads=(0, 1, 2, 1))


@pytest.fixture(scope="module")
def artifacts_home(model, tmp_path_factory):
    """A ``KVTRIM_HOME`` holding the sliced model's ``headkv`` and ``duo`` artifacts: the embedded SmolLM2's, cut to
    the same layers, KV heads and query heads (keyed by the sliced checkpoint, as vLLM's processes look them up)."""
    home = tmp_path_factory.mktemp("kvtrim_home")
    full, cut = checkpoint_stand_in(str(MODEL_DIR)), checkpoint_stand_in(str(model))
    q_heads = cut.config.num_attention_heads  # the KV heads' query groups, first in SmolLM2's order
    head = load_artifact(HEADKV_KIND, full).tensors
    scores = {n: head[n][:LAYERS, :q_heads] for n in ("retrieval", "retrieval_reasoning")}
    save_artifact(HEADKV_KIND, cut, scores, {"settings": {"cut_from": "smollm2-135m"}}, home / "artifacts")
    duo = load_artifact(DUO_KIND, full).tensors
    gates = {n: duo[n][:LAYERS, :KV_HEADS] for n in ("gates", "deviation")}
    save_artifact(DUO_KIND, cut, gates, {"settings": {"cut_from": "smollm2-135m"}}, home / "artifacts")
    return home


def _llm(config, model, tp: int, monkeypatch):
    if tp > 1:
        # vLLM's CPU workers: one OpenMP thread group per rank, ranks talk through gloo (CpuPlatform.dist_backend)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in range(tp)))
    return make_llm(config, model=str(model), block_size=BLOCK, tensor_parallel_size=tp)


def _generate(llm) -> list[list[int]]:
    prompts = [TokensPrompt(prompt_token_ids=p) for p in token_prompts(LENGTHS)]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _run(config, model, tp: int, monkeypatch):
    """``(tokens, state, stats, used)`` of one engine at ``tp`` ranks: the greedy tokens of the ``LENGTHS`` prompts,
    the scheduler's kvtrim state (None without ``config``), each rank's ``worker_stats`` and the blocks still in use
    afterwards, all read before the engine closes."""
    llm = _llm(config, model, tp, monkeypatch)
    try:
        tokens = _generate(llm)
        state = scheduler(llm)._kvtrim_state if config else None
        return tokens, state, llm.collective_rpc(worker_stats), used_blocks(llm)
    finally:
        close(llm)


@pytest.mark.parametrize(("method", "budget"), [("snapkv", BUDGET), ("tova", 32)])
def test_uniform_methods_at_two_ranks_keep_the_single_rank_tokens_and_blocks(model, method, budget, monkeypatch):
    """SnapKV selects per KV head: rank r scoring its own head r must select what one rank selects for it. TOVA
    averages its scores over all KV heads of a layer: the ranks average their heads' means (one all-reduce per
    layer), so each keeps the single-rank selection (each rank's own mean, without it, changes the tokens here)."""
    config = {"method": method, "budget": budget}
    vanilla = _run(None, model, 1, monkeypatch)[0]
    single = _run(config, model, 1, monkeypatch)[0]
    two, state, stats, used = _run(config, model, 2, monkeypatch)
    # One block table for both ranks: the scheduler freed the uniform count once.
    long = [n for n in LENGTHS if n > budget]
    freed = sum(_cdiv(n, BLOCK) - _cdiv(budget, BLOCK) for n in long)
    assert state.requests_compressed == len(long) and state.blocks_freed == freed
    assert used == 0
    assert len(stats) == 2
    for s in stats:  # each rank holds one KV head and compacted every long prompt in every layer
        assert s["kv_heads"] == 1 and s["requests_compressed"] == len(long)
        assert s["layer_evictions"] == len(long) * LAYERS
    assert two == single
    assert single != vanilla  # compression changed the tokens: the equality says something


@pytest.mark.parametrize(
    ("method", "budget"), [("headkv", BUDGET), ("critical_headkv", BUDGET), ("duo_attention", 256)]
)
def test_artifact_per_head_methods_at_two_ranks_keep_the_single_rank_tokens(
    model, artifacts_home, method, budget, monkeypatch
):
    """HeadKV, CriticalKV-HeadKV and DuoAttention fix every head's count from the artifact: rank r keeps head r's
    count of the whole model's split and selects what one rank selects for that head (CriticalKV reads the rank's
    own columns of ``o_proj``). The block list is sized by the largest
    (layer, rank) mean: with one head per rank, the largest head count (DuoAttention: a retrieval head keeps the
    whole prompt, so its requests free nothing)."""
    monkeypatch.setenv("KVTRIM_HOME", str(artifacts_home))  # read by this process and the spawned ranks
    config = {"method": method, "budget": budget}
    parsed = parse_config(config)
    pipeline = parsed.bound_pipeline(str(model))
    rows = {n: parsed.head_counts(pipeline, n, LAYERS, 1, tp_size=2) for n in LENGTHS}
    assert any(len(set(r.flatten().tolist())) > 1 for r in rows.values())  # the heads keep different counts
    single, single_state, _, _ = _run(config, model, 1, monkeypatch)
    two, state, stats, used = _run(config, model, 2, monkeypatch)
    long = [n for n in LENGTHS if n > budget]
    slots = {n: parsed.slot_count(n, LAYERS, BLOCK, rows[n], 1) for n in long}
    cut = [n for n in long if slots[n] < n]  # the scheduler shortens these block lists
    freed = sum(_cdiv(n, BLOCK) - _cdiv(slots[n], BLOCK) for n in cut)
    assert state.requests_compressed == len(cut) and state.blocks_freed == freed <= single_state.blocks_freed
    assert (len(cut), freed > 0) == ((0, False) if method == "duo_attention" else (2, True))
    assert used == 0
    assert sorted(s["tp_rank"] for s in stats) == [0, 1]
    for s in stats:  # each rank holds one KV head and compacted every long prompt in every layer (its own count)
        assert s["kv_heads"] == 1 and s["requests_compressed"] == len(long)
        assert s["layer_evictions"] == len(long) * LAYERS
    assert two == single


@pytest.mark.parametrize(
    ("method", "params"),
    [("adakv", {}), ("kvcompress", {"even_layer_evict": True, "block_size": 16, "protected_window": 8})],
)
def test_score_split_methods_with_head_groups_split_within_each_rank(four_head_model, method, params, monkeypatch):
    """AdaKV and KV-Compress with ``head_groups`` 2 on 4 KV heads: rank r holds heads 2r, 2r+1 (one group) and
    splits its group's share between them, as kvtrim's transformers path splits each group; the tokens at 2 ranks
    equal those at 1 and the transformers path's, and the scheduler frees the blocks it frees at one rank."""
    params = {**params, "head_groups": 2}
    config = {"method": method, "budget": BUDGET, "params": params}
    parsed = parse_config(config)
    single, single_state, _, _ = _run(config, four_head_model, 1, monkeypatch)
    two, state, stats, used = _run(config, four_head_model, 2, monkeypatch)
    long = [n for n in LENGTHS if n > BUDGET]
    slots = {n: parsed.slot_count(n, LAYERS, BLOCK, kv_heads=4) for n in long}
    freed = sum(_cdiv(n, BLOCK) - _cdiv(slots[n], BLOCK) for n in long if slots[n] < n)
    assert freed > 0 and state.blocks_freed == single_state.blocks_freed == freed
    assert state.requests_compressed == single_state.requests_compressed == len(long)
    assert used == 0
    assert sorted(s["tp_rank"] for s in stats) == [0, 1]
    for s in stats:  # each rank holds two KV heads, compacted every long prompt in every layer, split its heads
        assert s["kv_heads"] == 2 and s["requests_compressed"] == len(long)
        assert s["layer_evictions"] == len(long) * LAYERS and s["ragged_layers"] > 0
    assert two == single
    prompts = token_prompts(LENGTHS)
    assert two == transformers_tokens(four_head_model, prompts, method, GREEDY.max_tokens, params)
    # the grouping is seen: the same method over all 4 heads of a layer selects otherwise
    assert two != transformers_tokens(four_head_model, prompts, method, GREEDY.max_tokens, {**params, "head_groups": 1})


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
