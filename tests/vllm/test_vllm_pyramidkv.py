"""PyramidKV inside vLLM: per-layer kept counts under one block table (blocks sized by the largest layer)."""

from __future__ import annotations

import random

import pytest
import vllm_helpers  # first: sets vLLM environment variables before vLLM is imported

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

import torch
from vllm.inputs import TokensPrompt
from vllm_helpers import BLOCK, close, make_llm, scheduler, token_prompts, truncated_model, used_blocks, worker_state

from kvtrim.vllm.config import parse_config
from vllm import SamplingParams

pytestmark = pytest.mark.slow

LAYERS = 4  # a 4-layer cut of SmolLM2: four different PyramidKV layer budgets, cheap prefills
LENGTHS = [60, 300, 700]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CONFIG = {"method": "pyramidkv", "budget": 128}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _generate(llm, prompts) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("pyramid") / "smollm2-4layers", layers=LAYERS)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS)


@pytest.fixture
def layer_seq_lens(monkeypatch):
    """Record ``(layer name, seq_lens)`` of every attention call (what each layer's kernel reads)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    seen: list[tuple[str, list[int]]] = []
    orig = CPUAttentionBackendImpl.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        if attn_metadata is not None:
            seen.append((layer.layer_name, attn_metadata.seq_lens.tolist()))
        return orig(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", forward)
    return seen


def test_pyramid_budget_at_or_above_prompt_is_vanilla(model, prompts):
    llm = make_llm(model=str(model))
    try:
        vanilla = _generate(llm, prompts)
    finally:
        close(llm)
    llm = make_llm({"method": "pyramidkv", "budget": 2048}, model=str(model))
    try:
        assert _generate(llm, prompts) == vanilla
        assert scheduler(llm)._kvtrim_state.requests_compressed == 0
    finally:
        close(llm)


def test_pyramid_layers_read_their_own_counts_and_match_transformers(model, prompts, layer_seq_lens):
    config = parse_config(CONFIG)
    keeps = [config.layer_keeps(len(p), LAYERS) for p in prompts]
    assert len(set(keeps[2])) == LAYERS  # four different layer budgets: the test can tell layers apart
    llm = make_llm(CONFIG, model=str(model))
    try:
        out = _generate(llm, prompts)
        state = scheduler(llm)._kvtrim_state
        worker = worker_state(llm)
        # Blocks are sized by the largest layer: fewer are freed than a uniform method at the mean budget.
        freed = sum(_cdiv(len(p), BLOCK) - _cdiv(max(k), BLOCK) for k, p in zip(keeps, prompts, strict=True))
        assert freed > 0
        assert state.blocks_freed == freed
        assert state.requests_compressed == 2  # the 60-token prompt is under the budget
        assert used_blocks(llm) == 0 and state.dropped == {}
    finally:
        close(llm)
    # The last attention calls decode the 7th generated token: layer l of request r reads keep_l(r) + 7 entries.
    last = dict(layer_seq_lens[-LAYERS:])
    assert len(last) == LAYERS
    for name, seq_lens in last.items():
        layer = int(name.split(".")[2])
        assert seq_lens == [k[layer] + GREEDY.max_tokens - 1 for k in keeps], (name, seq_lens)
    # Per-layer offsets were recorded for the two compressed requests (the worker forgets them with its next step).
    assert len(worker.offsets) == 2 and all(
        off.tolist() == [max(k) - x for x in k] for off, k in zip(worker.offsets.values(), keeps[1:], strict=True)
    )

    # kvtrim's own PyramidKV on the transformers path, same weights and prompts: the same greedy tokens.
    from transformers import AutoModelForCausalLM

    import kvtrim

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    reference, vanilla = [], []
    for p in prompts:
        x = torch.tensor([p])
        cache = kvtrim.make_cache(hf, CONFIG["method"], budget=CONFIG["budget"])
        reference.append(hf.generate(x, past_key_values=cache, max_new_tokens=8, do_sample=False)[0, len(p) :])
        vanilla.append(hf.generate(x, max_new_tokens=8, do_sample=False)[0, len(p) :])
    assert out == [r.tolist() for r in reference]
    assert out != [v.tolist() for v in vanilla]  # compression changed the output, so the match says something


def test_pyramid_no_leaks_with_aborts(model):
    rng = random.Random(5)
    lengths = [rng.randint(100, 900) for _ in range(12)]
    prompts = token_prompts(lengths, seed=4)
    # 16 usable blocks: requests queue, and some are preempted.
    llm = make_llm(CONFIG, model=str(model), num_gpu_blocks_override=17)
    try:
        requests = {str(i): (p, vllm_helpers.greedy(rng.randint(1, 20))) for i, p in enumerate(prompts)}
        vllm_helpers.drive(llm.llm_engine, requests, abort_at={3: ["3", "7"], 6: ["6", "10"]})
        state, _ = vllm_helpers.assert_nothing_held(llm, "offsets")
        assert state.requests_compressed > 0
    finally:
        close(llm)


def test_pyramid_whose_largest_layer_keeps_the_prompt_frees_nothing_but_still_compresses(model):
    # Budget 158 of 300: PyramidKV caps layer 0 at the whole prompt, the deeper layers keep fewer entries.
    config = {"method": "pyramidkv", "budget": 158}
    prompt = token_prompts([300], seed=6)[0]
    keeps = parse_config(config).layer_keeps(len(prompt), LAYERS)
    assert max(keeps) == len(prompt) > min(keeps)
    llm = make_llm(config, model=str(model))
    try:
        out = _generate(llm, [prompt])[0]
        state = scheduler(llm)._kvtrim_state
        assert state.blocks_freed == 0 and used_blocks(llm) == 0
        # The worker forgets finished requests with its next step: the offsets are still there to check.
        assert [o.tolist() for o in worker_state(llm).offsets.values()] == [[max(keeps) - k for k in keeps]]
    finally:
        close(llm)
    from transformers import AutoModelForCausalLM

    import kvtrim

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    x = torch.tensor([prompt])
    cache = kvtrim.make_cache(hf, "pyramidkv", budget=158)
    assert out == hf.generate(x, past_key_values=cache, max_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
