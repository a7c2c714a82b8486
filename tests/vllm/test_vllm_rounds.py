"""Rounds inside vLLM: compression between prefill chunks and every N decoded tokens, blocks back to the pool."""

from __future__ import annotations

import itertools

import pytest
import vllm_helpers  # first: sets vLLM environment variables before vLLM is imported

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

import torch
from per_head_checks import check_sub_pages, generate, transformers_tokens, worker_state
from vllm.inputs import TokensPrompt
from vllm_helpers import close, make_llm, scheduler, token_prompts, truncated_model, used_blocks

from vllm import SamplingParams

pytestmark = pytest.mark.slow

LAYERS = 4
BLOCK = 32
CHUNK = 128  # max_num_batched_tokens: the prefill chunk
BUDGET = 64
EVERY = 16
TOKENS = 40  # 39 decoded tokens enter the cache: rounds at 16 and 32 of them


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("rounds") / "smollm2-4layers", layers=LAYERS)


def _llm(model, config, **kwargs):
    args = dict(model=str(model), block_size=BLOCK, max_num_batched_tokens=CHUNK, enable_chunked_prefill=True)
    args.update(kwargs)
    return make_llm(config, **args)


def _stepped(llm, prompt, tokens):
    """One request through ``add_request``/``step``; ``(tokens, blocks in use after each step)``."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("r", TokensPrompt(prompt_token_ids=prompt), params)
    used, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = list(o.outputs[0].token_ids)
        used.append(used_blocks(llm))
    return out, used


def _kvtrim_chunked(model, prompt, method, tokens, params: dict | None = None) -> list[int]:
    """kvtrim's own transformers path: ``Prefill.chunked`` (compress between chunks), then greedy decoding."""
    from transformers import AutoModelForCausalLM

    from kvtrim.compression.compressor import BudgetSpec
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.methods import get_method
    from kvtrim.runtime import Prefill, greedy_decode

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    pipeline, spec = get_method(method, **(params or {})), BudgetSpec(budget=BUDGET)
    ids = torch.tensor([prompt])
    with torch.inference_mode(), kvtrim_attention_enabled(hf):
        pre = Prefill.chunked(hf, ids, torch.ones_like(ids), CHUNK, pipeline, spec)
        out = pre.compressed(pipeline, spec)
        return greedy_decode(hf, out.cache, pre.mask, pre.logits, tokens).tokens[0]


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("snapkv@every:16", {}),
        ("streaming_llm@every:16", {}),
        ("tova@every:16", {}),
        ("adakv@every:16", {}),
        ("critical_adakv@every:16", {}),
        ("adakv@every:16", {"page_size": BLOCK}),
    ],
    ids=["snapkv", "streaming_llm", "tova", "adakv", "critical_adakv", "adakv-whole-pages"],
)
def test_rounds_bound_blocks_return_them_and_equal_kvtrims_chunked_path(model, method, params, monkeypatch):
    per_head = method.startswith(("adakv", "critical_adakv"))
    checked = check_sub_pages(monkeypatch)  # per-head: the sub-page invariants after every step
    prompt = token_prompts([700], seed=21)[0]
    llm = _llm(model, {"method": method, "budget": BUDGET, "between_chunks": True, "params": params})
    try:
        out, used = _stepped(llm, prompt, TOKENS)
        state = scheduler(llm)._kvtrim_state
        (peak,) = state.finished_peaks.values()  # vLLM's internal id of request "r"
        stats = worker_state(llm)
        assert used[-1] == 0 and state.dropped == {}
    finally:
        close(llm)
    # 6 chunks (5 full, 60 tokens): compressed after each, then at 16 and 32 decoded tokens
    assert state.rounds == stats.rounds == 6 + 2 and state.requests_compressed == 1
    # never more than budget + one chunk (+ one block) of blocks: 7, where the whole prompt takes 22; per-head
    # methods keep budget + block − 1 slots (95) after a round, so a chunk later the request spans 7 blocks too
    assert peak <= _cdiv(BUDGET + CHUNK, BLOCK) + 1 < _cdiv(len(prompt), BLOCK)
    assert max(used) <= _cdiv(BUDGET + CHUNK, BLOCK) + 1
    if params:  # whole pages: the uniform method's blocks (budget + one chunk), no block of slack
        assert peak == _cdiv(BUDGET + CHUNK, BLOCK)
    if per_head:
        assert stats.ragged_layers > 0 and len(checked) > 0  # heads kept different counts; pages were checked
    # decoding rounds return blocks: the count in use falls while the request decodes
    decoding = used[6:]
    assert any(b < a for a, b in itertools.pairwise(decoding))
    assert out == _kvtrim_chunked(model, prompt, method, TOKENS, params)
    # compressing after prefill only (the whole prompt scored at once) gives other tokens: the chunks mattered
    assert out != transformers_tokens(model, [prompt], method, TOKENS, params)[0]


@pytest.mark.parametrize(
    ("method", "kvc_block"),
    [("kvcompress", 16), ("kvcompress", BLOCK), ("kvcompress@every:16", 16)],
    ids=["own-blocks", "vllm-blocks", "decoding-metric"],
)
def test_kvcompress_between_chunks_keeps_its_layer_blocks_and_equals_kvtrims_chunked_path(
    model, monkeypatch, method, kvc_block
):
    """KV-Compress (even_layer_evict) after every chunk: each layer keeps ⌈B·H/bs⌉ of its blocks, split among its
    heads by its ranking; the request keeps ⌈B·H/bs⌉/H blocks' worth + block − 1 slots of vLLM's list, or, with
    KV-Compress's blocks equal to vLLM's, exactly the pages of the ranking (B = 64: 2 blocks, as SnapKV). With
    ``@every:16`` its running metric adds each chunk's queries after the first round and each decoded query, and
    rounds follow at 16 and 32 decoded tokens (kvtrim's chunked path accumulates the same metric step by step)."""
    checked = check_sub_pages(monkeypatch)
    prompt = token_prompts([700], seed=21)[0]
    params = {"even_layer_evict": True, "block_size": kvc_block}
    llm = _llm(model, {"method": method, "budget": BUDGET, "params": params, "between_chunks": True})
    try:
        out, used = _stepped(llm, prompt, TOKENS)
        state = scheduler(llm)._kvtrim_state
        (peak,) = state.finished_peaks.values()
        stats = worker_state(llm)
        assert used[-1] == 0 and state.dropped == {}
    finally:
        close(llm)
    decoding = 2 if "@every" in method else 0  # rounds at 16 and 32 decoded tokens
    assert state.rounds == stats.rounds == 6 + decoding and state.requests_compressed == 1  # one per chunk
    slack = 0 if kvc_block == BLOCK else BLOCK - 1
    assert peak <= _cdiv(BUDGET + slack + CHUNK, BLOCK) < _cdiv(len(prompt), BLOCK)
    assert stats.ragged_layers > 0 and len(checked) > 0
    assert out == _kvtrim_chunked(model, prompt, method, TOKENS, params)
    if decoding:  # the running metric is not the chunk-by-chunk window metric
        assert out != _kvtrim_chunked(model, prompt, "kvcompress", TOKENS, params)


def test_budget_above_the_prompt_is_vanilla_and_admission_counts_the_compressed_size(model):
    prompts = token_prompts([300, 700], seed=22)
    vanilla = _llm(model, None)
    try:
        expected = generate(vanilla, prompts, 12)
    finally:
        close(vanilla)
    llm = _llm(model, {"method": "snapkv@every:16", "budget": 1024, "between_chunks": True})
    try:
        assert generate(llm, prompts, 12) == expected
        assert scheduler(llm)._kvtrim_state.rounds == 0 and used_blocks(llm) == 0
    finally:
        close(llm)
    # A 12-block pool (384 slots, block 0 is vLLM's null block): vLLM would refuse to start (max_model_len 1024
    # does not fit) and its full-sequence admission gate would never admit a 700-token prompt; kvtrim counts
    # budget + one chunk (6 blocks), so both requests are admitted and finish.
    config = {"method": "snapkv@every:16", "budget": BUDGET, "between_chunks": True}
    llm = _llm(model, config, num_gpu_blocks_override=13, max_model_len=1024)
    try:
        engine = llm.llm_engine
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i in range(2):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompts[1]), params)
        finished, running = 0, []
        for _ in range(200):  # a request the gate never admits would wait forever: bounded steps instead
            finished += sum(o.finished for o in engine.step())
            running.append(len(scheduler(llm).running))
            if not engine.has_unfinished_requests():
                break
        assert finished == 2 and max(running) == 2 and used_blocks(llm) == 0
        assert max(scheduler(llm)._kvtrim_state.finished_peaks.values()) <= _cdiv(BUDGET + CHUNK, BLOCK) + 1
    finally:
        close(llm)


@pytest.mark.parametrize("method", ["snapkv", "adakv"])
def test_decode_reserve_admits_with_room_for_the_decoded_tokens(model, monkeypatch, method):
    """Admitted by their compressed size, six 400-token requests outgrow a 16-block pool while decoding 96 tokens
    and vLLM preempts some (each recomputes its prompt); with ``decode_reserve`` 96 a request is admitted only when
    it and the running requests have room for their reserved decoded tokens: no preemption, still batched."""
    preempted = vllm_helpers.count_preemptions(monkeypatch)
    prompts = token_prompts([400] * 6, seed=31)
    tokens = 96
    runs = {}
    for reserve in (0, tokens):
        config = {"method": method, "budget": BUDGET, "between_chunks": True, "decode_reserve": reserve}
        if method == "adakv":
            config["params"] = {"page_size": BLOCK}  # the uniform method's blocks (whole pages)
        llm = _llm(model, config, num_gpu_blocks_override=17, max_model_len=512)  # one whole request fits
        try:
            engine = llm.llm_engine
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), params)
            done, running = {}, []
            for _ in range(3000):
                for o in engine.step():
                    if o.finished:
                        done[o.request_id] = list(o.outputs[0].token_ids)
                running.append(len(scheduler(llm).running))
                if not engine.has_unfinished_requests():
                    break
            assert sorted(done) == [str(i) for i in range(6)] and {len(t) for t in done.values()} == {tokens}
            assert used_blocks(llm) == 0
            runs[reserve] = (len(preempted), max(running))
            preempted.clear()
        finally:
            close(llm)
    assert runs[0][0] > 0, "without a reserve no request was preempted: the pool is too large for this test"
    assert runs[tokens][0] == 0 and runs[tokens][1] >= 2, runs


@pytest.mark.parametrize("method", ["snapkv@every:200", "adakv@every:200"])
def test_rounds_leak_nothing_under_preemption_and_aborts(tmp_path, monkeypatch, method):
    """Rounds in every phase on a pool that forces preemptions (recomputed requests are compressed again); AdaKV:
    each round re-places every head's entries in its request's sub-pages."""
    import random

    preempted = vllm_helpers.count_preemptions(monkeypatch)
    checked = check_sub_pages(monkeypatch)
    model = truncated_model(tmp_path / "smollm2-2layers", layers=2)
    rng = random.Random(5)
    prompts = token_prompts([rng.randint(40, 900) for _ in range(12)], seed=23)
    # every 200 decoded tokens: a request may hold budget + 200 entries (9 blocks), so the 9-block pool preempts
    # (AdaKV: budget + block − 1 + 200 slots, 10 blocks, on an 11-block pool)
    config = {"method": method, "budget": BUDGET, "between_chunks": True}
    per_head = method.startswith("adakv")
    llm = _llm(model, config, num_gpu_blocks_override=10 + per_head, max_model_len=1024)
    try:
        requests = {str(i): (p, vllm_helpers.greedy(rng.randint(1, 260))) for i, p in enumerate(prompts)}
        flush = dict(flush_prompt=prompts[0][:8], flush_params=SamplingParams(max_tokens=1))
        vllm_helpers.drive(llm.llm_engine, requests, abort_at={5: ["5"], 11: ["11"]}, max_steps=2000, **flush)
        state, worker = vllm_helpers.assert_nothing_held(llm, "positions", "recent", "heads", "head_positions")
        assert state.rounds == worker.rounds > len(prompts) and preempted
        slots = BUDGET + (BLOCK - 1) * per_head
        assert max(state.finished_peaks.values()) <= _cdiv(slots + 200, BLOCK) + 1
        assert not per_head or (worker.ragged_layers > 0 and len(checked) > 0)
    finally:
        close(llm)
