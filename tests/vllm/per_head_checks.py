"""Checks shared by the per-head vLLM tests (imported after ``vllm_helpers`` has set vLLM's environment)."""

from __future__ import annotations

import torch
from vllm.inputs import TokensPrompt
from vllm_helpers import close, make_llm, scheduler, used_blocks, worker_state

from kvtrim.vllm.config import parse_config
from vllm import SamplingParams

LAYERS = 4  # a 4-layer cut of SmolLM2 (3 KV heads per layer): cheap prefills, per-head counts in every layer
BLOCK = 32  # vLLM's smallest CPU block size: the one extra block per-head methods hold costs least
LENGTHS = [60, 300, 700]
BUDGET = 64
KV_HEADS = 3


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def generate(llm, prompts, tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def check_sub_pages(monkeypatch) -> list[int]:
    """Check every per-head request's sub-pages at each folded step; returns the rows of each step checked."""
    from kvtrim.vllm import worker_patch

    checked: list[int] = []
    orig = worker_patch.HeadStep.__init__

    def checking_init(self, rows):
        for *_, pages, _ in rows:
            pages.check()  # each head's sub-pages cover its length; none used twice; used + free = owned blocks
        checked.append(len(rows))
        orig(self, rows)

    monkeypatch.setattr(worker_patch.HeadStep, "__init__", checking_init)
    return checked


def transformers_tokens(
    model, prompts, method: str | None, tokens: int, params: dict | None = None
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    import kvtrim

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    out = []
    for p in prompts:
        cache = None if method is None else kvtrim.make_cache(hf, method, budget=BUDGET, **(params or {}))
        kwargs = {} if cache is None else {"past_key_values": cache}
        ids = hf.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False, **kwargs)
        out.append(ids[0, len(p) :].tolist())
    return out


def check_tokens_and_blocks(
    model, prompts, method: str, params: dict | None = None, min_ragged: int | None = None, slots: int | None = None
) -> None:
    """24 greedy tokens equal the transformers path's; blocks freed follow the slot count; heads split (per-head).

    ``params``: the method's own parameters, in the plugin's configuration and in ``kvtrim.make_cache``;
    ``min_ragged``: fewest (request, layer) pairs whose heads keep different counts (None: every pair);
    ``slots``: the slots each compressed request keeps (None: ``B + block − 1`` per head, ``B`` uniform)."""
    raw = {"method": method, "budget": BUDGET, "params": dict(params or {})}
    config = parse_config(raw)
    llm = make_llm(raw, model=str(model), block_size=BLOCK)
    try:
        out = generate(llm, prompts, 24)  # 24 decoded tokens: heads fill and open sub-pages while decoding
        state = scheduler(llm)._kvtrim_state
        worker = worker_state(llm)
        assert state.requests_compressed == 2  # the 60-token prompt is under the budget
        # Per-head: the block list keeps B + block − 1 slots, 3 blocks of 32 instead of 10 and 22 (uniform: 2).
        expected = slots if slots is not None else BUDGET + BLOCK - 1 if config.per_head else BUDGET
        slots = [config.slot_count(len(p), LAYERS, BLOCK, kv_heads=KV_HEADS) for p in prompts[1:]]
        assert slots == [expected] * 2
        freed = sum(_cdiv(len(p), BLOCK) - _cdiv(s, BLOCK) for p, s in zip(prompts[1:], slots, strict=True))
        assert state.blocks_freed == freed
        # every layer of both requests split its heads unevenly (per-head methods; at least ``min_ragged`` pairs
        # when counts come in whole blocks, which may split a layer evenly)
        ragged = worker.ragged_layers
        assert worker.evictions == 2
        assert ragged == (2 * LAYERS if config.per_head else 0) if min_ragged is None else ragged >= min_ragged
        assert used_blocks(llm) == 0 and state.dropped == {}
    finally:
        close(llm)
    assert out == transformers_tokens(model, prompts, method, 24, params)
    assert out != transformers_tokens(
        model, prompts, None, 24
    )  # compression changed the output: the match says something
    if method == "adakv":
        assert out != transformers_tokens(model, prompts, "snapkv", 24)  # per-head budgets differ from uniform ones
