"""Shared helpers of the vLLM tests (importing this module does not import vLLM)."""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

# Before vLLM is imported (the test modules import this first): engine core in this process (tests also read
# the scheduler's counters), a small CPU KV cache, no thread pinning on a shared machine. Not a conftest.py:
# other test modules import helpers from the top-level ``conftest`` by that name.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

MODEL_DIR = Path.home() / ".cache" / "kvtrim" / "models" / "smollm2-135m"
BLOCK = 128  # vLLM CPU backend's default block size


def token_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Deterministic prompts of the given token counts (ids from the common part of the vocabulary)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(200, 20000, size=n).tolist() for n in lengths]


def truncated_model(dst: Path, layers: int = 2) -> Path:
    """A copy of the embedded SmolLM2 with only its first ``layers`` decoder layers (same tokenizer, heads, blocks).

    For tests about block bookkeeping, where the model's depth only costs time: 2 of 30 layers make a prefill
    about 15 times cheaper, so hundreds of requests fit in a test.
    """
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(MODEL_DIR / "model.safetensors")
    kept = {
        name: t
        for name, t in tensors.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((MODEL_DIR / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (MODEL_DIR / name).exists():
            shutil.copy(MODEL_DIR / name, dst / name)
    return dst


def head_sliced_model(dst: Path, layers: int = 2, kv_heads: int = 2, heads: tuple[int, ...] | None = None) -> Path:
    """A cut of the embedded SmolLM2 with its first ``layers`` layers and first ``kv_heads`` KV heads.

    SmolLM2 has 3 KV heads (9 query heads, 3 per KV head), which tensor parallelism over 2 ranks cannot split;
    keeping KV heads ``0 … kv_heads−1`` with their query heads (rows of ``q_proj``/``k_proj``/``v_proj``, columns
    of ``o_proj``) gives a model with trained weights (peaked logits: greedy tokens are not decided by rounding)
    whose KV heads divide by 2. ``head_dim`` stays 64, so ``hidden_size`` (576) ≠ heads · head_dim. ``heads``: the
    source KV heads in order instead. A head may repeat (``(0, 1, 2, 1)``: 4 KV heads with trained weights); each
    copy's ``o_proj`` columns are divided by its number of copies, so the copies together add what the source head
    adds and, uncompressed, the model computes what the cut of its distinct heads computes.
    """
    from safetensors.torch import load_file, save_file

    heads = tuple(range(kv_heads)) if heads is None else tuple(heads)
    config = json.loads((MODEL_DIR / "config.json").read_text())
    group = config["num_attention_heads"] // config["num_key_value_heads"]
    d = config["head_dim"]
    q_rows = torch.cat([torch.arange(h * group * d, (h + 1) * group * d) for h in heads])
    kv_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])
    truncated_model(dst, layers=layers)
    tensors = load_file(dst / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith("self_attn.q_proj.weight"):
            tensors[name] = t[q_rows].contiguous()
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            tensors[name] = t[kv_rows].contiguous()
        elif name.endswith("self_attn.o_proj.weight"):
            copies = torch.tensor([heads.count(h) for h in heads], dtype=t.dtype).repeat_interleave(group * d)
            tensors[name] = (t[:, q_rows] / copies).contiguous()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config.update(num_hidden_layers=layers, num_attention_heads=len(heads) * group, num_key_value_heads=len(heads))
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def make_llm(config: dict | None = None, **kwargs):
    """A ``vllm.LLM`` on the embedded SmolLM2 (float32, eager, no prefix caching), kvtrim on when ``config``."""
    from vllm import LLM

    args = dict(
        model=str(MODEL_DIR),
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=8,
        seed=0,
    )
    args.update(kwargs)
    if config is not None:
        args["additional_config"] = {"kvtrim": config}
    return LLM(**args)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def scheduler(llm):
    """The in-process scheduler (VLLM_ENABLE_V1_MULTIPROCESSING=0), for exact block counts."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def used_blocks(llm) -> int:
    pool = scheduler(llm).kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # block 0 is vLLM's null block


def gauge(llm, name: str) -> float:
    """A gauge from ``LLM.get_metrics()`` (vLLM's public metrics snapshot)."""
    values = [m.value for m in llm.get_metrics() if m.name == name]
    assert values, f"metric {name} not reported"
    return float(values[-1])


def worker_state(llm):
    """kvtrim's state on the in-process worker's model runner."""
    engine = llm.llm_engine.engine_core.engine_core
    return engine.model_executor.driver_worker.worker.model_runner._kvtrim_state


def greedy(max_tokens: int):
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def count_preemptions(monkeypatch) -> list[str]:
    """The ids of the requests vLLM's scheduler preempts from now on, one entry per preemption."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preempted: list[str] = []
    orig = Scheduler._preempt_request

    def counting(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return orig(self, request, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "_preempt_request", counting)
    return preempted


def drive(
    engine,
    requests: dict,
    *,
    abort_at: dict[int, list[str]] | None = None,
    abort_chance: float = 0.0,
    rng=None,
    on_step=None,
    max_steps: int = 5000,
    flush_prompt: list[int] | None = None,
    flush_params=None,
) -> list[str]:
    """Add ``requests`` (id → (prompt token ids, sampling params)), step ``engine`` until all finish, then flush.

    After step ``s`` (counted from 1): ``on_step()`` runs, the ids of ``abort_at[s]`` are aborted, and with
    probability ``abort_chance`` (drawn from ``rng``) one unfinished request chosen by ``rng``. At most
    ``max_steps`` steps, and the engine must be done by then. The worker hears of the last aborts with the next
    scheduled step: a short request (``flush_prompt``, by default 8 tokens, one greedy token) delivers them.
    Returns the aborted ids, in order.
    """
    from vllm.inputs import TokensPrompt

    abort_at = abort_at or {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    outstanding = set(requests)
    aborted: list[str] = []
    steps = 0
    while engine.has_unfinished_requests() and steps < max_steps:
        for out in engine.step():
            if out.finished:
                outstanding.discard(out.request_id)
        steps += 1
        if on_step is not None:
            on_step()
        if steps in abort_at:
            engine.abort_request(abort_at[steps])
            outstanding.difference_update(abort_at[steps])
            aborted.extend(abort_at[steps])
        if abort_chance and outstanding and rng.random() < abort_chance:
            victim = rng.choice(sorted(outstanding))
            engine.abort_request([victim])
            outstanding.discard(victim)
            aborted.append(victim)
    assert not engine.has_unfinished_requests(), f"requests left after {max_steps} steps"
    if flush_prompt is None:
        flush_prompt = token_prompts([8], seed=3)[0]
    if flush_params is None:
        from vllm import SamplingParams

        flush_params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request("flush", TokensPrompt(prompt_token_ids=flush_prompt), flush_params)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests(), "the flush request did not finish"
    return aborted


def assert_nothing_held(llm, *worker_maps: str):
    """No request left, no block used, nothing in kvtrim's scheduler and worker ``dropped`` maps.

    ``worker_maps``: further per-request maps of the worker state that must be empty (``"heads"``, ...).
    Returns kvtrim's scheduler and worker states, for the test's own checks.
    """
    state, worker = scheduler(llm)._kvtrim_state, worker_state(llm)
    assert not llm.llm_engine.has_unfinished_requests()
    # Exact count from the block pool (the usage gauge is only refreshed by the next scheduled step).
    assert used_blocks(llm) == 0, used_blocks(llm)
    assert state.dropped == {}, state.dropped
    assert worker.dropped == {}, worker.dropped
    for name in worker_maps:
        assert getattr(worker, name) == {}, (name, sorted(getattr(worker, name)))
    return state, worker
