"""LagKV's recursion inside vLLM: between prefill chunks and every ``lag`` decoded tokens, blocks back to the pool."""

from __future__ import annotations

import itertools
import random

import pytest
import vllm_helpers  # first: sets vLLM environment variables before vLLM is imported

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

import torch
from per_head_checks import worker_state
from vllm.inputs import TokensPrompt
from vllm_helpers import close, make_llm, scheduler, token_prompts, truncated_model, used_blocks

from kvtrim.vllm.config import parse_config
from vllm import SamplingParams

pytestmark = pytest.mark.slow

LAYERS = 4
BLOCK = 32
CHUNK = 128  # max_num_batched_tokens: the prefill chunk
RATIO = 0.5  # 16 of every 32-token partition kept
PARAMS = {"sink": 4, "lag": 32}
TOKENS = 41  # 40 decoded tokens enter the cache: rounds while decoding at 708 and 740 tokens


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("lagkv") / "smollm2-4layers", layers=LAYERS)


def _config(method: str, between_chunks: bool) -> dict:
    return {"method": method, "ratio": RATIO, "params": PARAMS, "between_chunks": between_chunks}


def _llm(model, config, **kwargs):
    args = dict(model=str(model), block_size=BLOCK, max_num_batched_tokens=CHUNK, enable_chunked_prefill=True)
    args.update(kwargs)
    return make_llm(config, **args)


def _stepped(llm, prompt, tokens):
    """One request through ``add_request``/``step``; ``(tokens, (computed tokens, blocks in use) after each step)``."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("r", TokensPrompt(prompt_token_ids=prompt), params)
    steps, out = [], None
    (req,) = scheduler(llm).requests.values()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = list(o.outputs[0].token_ids)
        steps.append((req.num_computed_tokens, used_blocks(llm)))
    return out, steps


def _expected(config: dict, prompt_len: int, ends: list[int]) -> tuple[list[int], int]:
    """Entries held after each step ending at ``ends[i]`` tokens, and the rounds, by the plugin's own rule."""
    c = parse_config(config)
    physical, dropped, held, rounds = 0, 0, [], 0
    last = 0
    for end in ends:
        physical += end - last
        keep = c.round_keep(prompt_len, end, physical, end - last)
        if keep is not None:
            dropped += physical - keep
            physical, rounds = keep, rounds + 1
        held.append(physical)
        last = end
    return held, rounds


def _kvtrim_tokens(model, prompt, method, tokens, chunk: int | None) -> list[int]:
    """kvtrim's own transformers path with LagKV's recursion (``tail:LAG``): ``model.generate`` with
    ``kvtrim.make_cache`` (one prefill), or ``Prefill.chunked`` (compressing between chunks when the tail is full)
    followed by greedy decoding."""
    from transformers import AutoModelForCausalLM

    import kvtrim
    from kvtrim.compression.compressor import BudgetSpec
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.methods import get_method
    from kvtrim.runtime import Prefill, greedy_decode

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    ids = torch.tensor([prompt])
    if chunk is None:
        cache = kvtrim.make_cache(hf, method, ratio=RATIO, **PARAMS)
        out = hf.generate(ids, max_new_tokens=tokens, do_sample=False, past_key_values=cache)
        return out[0, len(prompt) :].tolist()
    pipeline, spec = get_method(method, **PARAMS), BudgetSpec(ratio=RATIO)
    with torch.inference_mode(), kvtrim_attention_enabled(hf):
        pre = Prefill.chunked(hf, ids, torch.ones_like(ids), chunk, pipeline, spec)
        done = pre.compressed(pipeline, spec)
        return greedy_decode(hf, done.cache, pre.mask, pre.logits, tokens).tokens[0]


@pytest.mark.parametrize(
    ("method", "between_chunks"), [("lagkv", True), ("lagkv", False), ("lag_knorm", True)]
)
def test_recursion_equals_kvtrims_path_and_returns_blocks(model, method, between_chunks):
    prompt = token_prompts([700], seed=31)[0]
    config = _config(method, between_chunks)
    llm = _llm(model, config)
    try:
        out, steps = _stepped(llm, prompt, TOKENS)
        state = scheduler(llm)._kvtrim_state
        (peak,) = state.finished_peaks.values()
        stats = worker_state(llm)
        assert steps[-1][1] == 0 and state.dropped == {}  # the worker forgets it on its next step (see below)
    finally:
        close(llm)
    held, rounds = _expected(config, len(prompt), [c for c, _ in steps])
    # the pool holds exactly the blocks of the entries the recursion keeps, after every step but the last (which
    # finishes the request and frees everything)
    assert [u for _, u in steps[:-1]] == [_cdiv(h, BLOCK) for h in held[:-1]]
    assert state.rounds == stats.rounds == rounds
    # 6 prefill steps; rounds while decoding: 8 tokens after the prompt (the tail reaches 2 partitions), then
    # every 32 (2 rounds in the 40 decoded tokens that enter the cache)
    decoding = [u for c, u in steps[:-1] if c > len(prompt)]
    assert any(b < a for a, b in itertools.pairwise(decoding))  # a decoding round returned a block
    assert rounds == (6 if between_chunks else 1) + 2
    # blocks stay under the admission bound (LagKV keeps 16 of each 32-token partition), below the prompt's 22:
    # while decoding, and (between_chunks) in every step, the scheduler's own peak included
    bound = _cdiv(parse_config(_config(method, True)).admission_tokens(len(prompt) + TOKENS, CHUNK), BLOCK)
    assert max(decoding) <= bound < _cdiv(len(prompt), BLOCK)
    if between_chunks:
        assert max(u for _, u in steps) <= bound and peak <= bound
    assert out == _kvtrim_tokens(model, prompt, method, TOKENS, CHUNK if between_chunks else None)


def test_recursion_leaks_nothing_under_preemption_and_aborts(tmp_path, monkeypatch):
    """LagKV's rounds in every phase on a pool that forces preemptions (recomputed requests start over)."""
    preempted = vllm_helpers.count_preemptions(monkeypatch)
    model = truncated_model(tmp_path / "smollm2-2layers", layers=2)
    rng = random.Random(7)
    prompts = token_prompts([rng.randint(40, 150) for _ in range(6)], seed=32)
    # 14 of every 16-token partition kept: a decoding request grows by 7 entries every 8 tokens. vLLM's start-up
    # check needs one 256-token request to fit (LagKV's requests grow: no bound), 8 blocks of 32, all the pool
    # has, so two requests decoding at once outgrow it and one is preempted.
    config = {"method": "lagkv", "ratio": 0.125, "params": {"sink": 4, "lag": 16}, "between_chunks": True}
    llm = _llm(model, config, num_gpu_blocks_override=9, max_model_len=256)
    try:
        requests = {str(i): (p, vllm_helpers.greedy(rng.randint(1, 80))) for i, p in enumerate(prompts)}
        flush = dict(flush_prompt=prompts[0][:8], flush_params=SamplingParams(max_tokens=1))
        vllm_helpers.drive(llm.llm_engine, requests, abort_at={5: ["5"], 13: ["1"], 40: ["4"]}, max_steps=3000, **flush)
        state, worker = vllm_helpers.assert_nothing_held(llm, "positions", "recent")
        assert state.rounds == worker.rounds > len(prompts) and preempted
    finally:
        close(llm)
