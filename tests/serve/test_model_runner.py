"""The model runner driven directly, without the engine loop: packed prefill chunks, decode steps, batched eviction
and the token read on bare paged sequences give the engine's tokens; the runner never touches a request's lifecycle;
the graph-free static decode step runs on CPU."""

from __future__ import annotations

import ast
import dataclasses
import gc
import inspect
import random
import weakref

import pytest
import torch
from test_engine import greedy_alone

from conftest import byte_tokenizer, tiny_model
from kvtrim.errors import InvalidParameterError
from kvtrim.methods.presets import KV_COMPRESS
from kvtrim.serve import model_runner as runner_mod
from kvtrim.serve.engine import Engine
from kvtrim.serve.model_runner import ModelRunner, PrefillChunk
from kvtrim.serve.scheduler import max_cache_tokens
from kvtrim.serve.types import SamplingParams

BLOCK, MIN_CACHE, PROTECTED, CHUNK = 4, 8, 4, 24
GREEDY = SamplingParams(max_tokens=1)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(30, 70))] for _ in range(n)]


def _engine_tokens(model, prompts: list[list[int]], max_tokens: int, cr: float, **options) -> list[list[int]]:
    engine = Engine(
        model, byte_tokenizer(), kv_blocks=600, block_size=BLOCK, compression_rate=cr, min_cache_tokens=MIN_CACHE,
        protected_window=PROTECTED, prefill_chunk=CHUNK, **options,
    )  # fmt: skip
    handles = [engine.submit(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    engine.run_until_idle()
    return [h.result(timeout=0).token_ids for h in handles]


def _runner(model, cr: float, **options) -> ModelRunner:
    eviction = dataclasses.replace(KV_COMPRESS["kvcompress"], protected_window=PROTECTED) if cr > 1 else None
    return ModelRunner(model, kv_blocks=600, block_size=BLOCK, eviction=eviction, continual_metric=cr > 1, **options)


def _budget(seq, cr: float) -> int:
    return max_cache_tokens(seq.seen, cr, MIN_CACHE, BLOCK)


def _compress(runner: ModelRunner, seq, cr: float) -> int:
    """Evict ``seq`` to its budget on the runner and check the result on its own terms: at most one partial block
    per table above the budget, and every head still holds the protected newest positions."""
    budget = _budget(seq, cr)
    freed = runner.compress([seq], [budget])[0]
    assert seq.blocks_held() <= runner.geometry.budget_blocks(budget) + runner.geometry.tables
    positions = seq.gather()["positions"]  # [layers, kv_heads, S]
    for p in range(seq.seen - PROTECTED, seq.seen):
        assert bool((positions == p).any(-1).all()), f"position {p} evicted from a head"
    return freed


def _greedy(runner: ModelRunner, logits: torch.Tensor, rows: list[int] | None = None) -> list[int]:
    n = logits.shape[0] if rows is None else len(rows)
    tokens = runner.sample(logits, [GREEDY] * n, [torch.Generator()] * n, rows)
    assert not any(isinstance(t, Exception) for t in tokens), tokens
    return tokens


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("cr", [1.0, 4.0])
def test_one_sequence_through_the_runner_gives_the_engine_tokens(model, cr, static):
    """A prompt fed in ``prefill_chunk`` chunks (compressed after each), then decode steps each preceded by a
    compression to the budget: the engine's schedule for a lone request, run on the runner alone, gives its tokens.
    ``static``: decode steps through the static buffers (the CUDA-graph step, eagerly: what CPU can run)."""
    (prompt,) = _prompts(1, seed=7)
    max_tokens = 12
    options = {"decode_buckets": True, "static_decode": True} if static else {}
    expected = _engine_tokens(model, [prompt], max_tokens, cr, **options)[0]

    runner = _runner(model, cr, **options)
    seq = runner.new_sequence()
    freed = 0
    for start in range(0, len(prompt), CHUNK):
        logits = runner.prefill([PrefillChunk(seq, prompt[start : start + CHUNK])])
        assert seq.seen == min(start + CHUNK, len(prompt))
        if cr > 1 and seq.seen < len(prompt):
            freed += _compress(runner, seq, cr)
    tokens = _greedy(runner, logits[-1:])
    while len(tokens) < max_tokens:
        if cr > 1:
            freed += _compress(runner, seq, cr)
        tokens += _greedy(runner, runner.decode([seq], [tokens[-1]]))
    assert tokens == expected
    if cr == 1:  # independent of the engine: the request alone on a full DynamicCache
        assert tokens == greedy_alone(model, prompt, max_tokens, eos=set())
    assert (freed > 0) == (cr > 1)
    if cr > 1:
        assert seq.entries() < seq.seen * runner.geometry.tables  # really evicted
    captured, replayed, eager_static = runner.graph_counts()
    assert (captured, replayed) == (0, 0) and eager_static == (max_tokens - 1 if static else 0)
    seq.release()
    assert runner.pool.num_used == 0


def test_packed_prefill_and_batched_decode_give_the_engine_tokens(model):
    """Chunks of different lengths in one packed prefill call, then every sequence in one decode call per step
    (with padding rows: batch 3 runs in bucket 4): the tokens of the engine."""
    prompts = _prompts(3, seed=11)
    max_tokens = 10
    expected = _engine_tokens(model, prompts, max_tokens, 1.0)
    runner = _runner(model, 1.0, decode_buckets=True)
    seqs = [runner.new_sequence() for _ in prompts]
    fed = [0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    while any(n < len(p) for n, p in zip(fed, prompts, strict=True)):  # every step: one chunk of each unfinished one
        rows = [i for i, p in enumerate(prompts) if fed[i] < len(p)]
        chunks = [PrefillChunk(seqs[i], prompts[i][fed[i] : fed[i] + CHUNK]) for i in rows]
        logits = runner.prefill(chunks)
        assert logits.shape[0] == len(rows)
        for i, chunk in zip(rows, chunks, strict=True):
            fed[i] += len(chunk.tokens)
        done = [row for row, i in enumerate(rows) if fed[i] == len(prompts[i])]
        for row, token in zip(done, _greedy(runner, logits, done), strict=True):
            tokens[rows[row]].append(token)
    for _ in range(max_tokens - 1):
        for i, token in enumerate(_greedy(runner, runner.decode(seqs, [t[-1] for t in tokens]))):
            tokens[i].append(token)
    assert tokens == expected == [greedy_alone(model, p, max_tokens, eos=set()) for p in prompts]
    for seq in seqs:
        seq.release()
    assert runner.pool.num_used == 0


def test_the_runner_never_touches_request_lifecycle(model):
    """The runner frees no block and keeps no sequence between calls: creating, finishing and releasing a sequence
    are its caller's. Its module knows nothing of requests, handles, events or the engine."""
    runner = _runner(model, 4.0, decode_buckets=True, static_decode=True)
    (prompt,) = _prompts(1, seed=3)
    seq = runner.new_sequence()
    assert runner.pool.num_used == 0 and seq.seen == 0
    token = _greedy(runner, runner.prefill([PrefillChunk(seq, prompt)]))[0]
    for _ in range(5):
        runner.compress([seq], [_budget(seq, 4.0)])
        token = _greedy(runner, runner.decode([seq], [token]))[0]
    assert runner.pool.num_used == seq.blocks_held() > 0  # nothing released behind the caller's back
    seq.release()
    assert runner.pool.num_used == 0
    gone = weakref.ref(seq)
    del seq
    gc.collect()
    assert gone() is None  # no reference kept (a finished request's table slot goes back when it is collected)

    tree = ast.parse(inspect.getsource(runner_mod))
    serve_imports = {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1  # from .x import y: within kvtrim.serve
        for alias in node.names
    }
    assert serve_imports == {("decode_graphs", "DecodeGraphRunner"), ("scheduler", "BlockGeometry"),
                             ("types", "SamplingParams")}  # fmt: skip


def test_sampling_errors_stay_in_their_row(model, monkeypatch):
    """One host read for the batch's argmax; a row whose sampling raises gets its exception, the others their
    tokens."""
    runner = _runner(model, 1.0)
    real = runner_mod.sample_token

    def flaky(logits, params, generator, greedy=None):
        if params.seed == 666:
            raise RuntimeError("sampler exploded")
        return real(logits, params, generator, greedy)

    monkeypatch.setattr(runner_mod, "sample_token", flaky)
    logits = torch.randn(3, 8)
    params = [GREEDY, SamplingParams(seed=666), SamplingParams(temperature=0.7, seed=1)]
    out = runner.sample(logits, params, [torch.Generator().manual_seed(1) for _ in params])
    assert out[0] == int(logits[0].argmax()) and isinstance(out[1], RuntimeError) and isinstance(out[2], int)
    with pytest.raises(InvalidParameterError, match="one params and one generator per row"):
        runner.sample(logits, params[:2], [torch.Generator()] * 3)


def test_runner_options_are_checked(model):
    with pytest.raises(InvalidParameterError, match="exactly one of kv_memory_bytes and kv_blocks"):
        ModelRunner(model)
    with pytest.raises(InvalidParameterError, match="CUDA device, it is on cpu"):
        ModelRunner(model, kv_blocks=10, decode_buckets=True, cuda_graphs=True)
    with pytest.raises(InvalidParameterError, match="continual_metric=True needs an eviction preset"):
        ModelRunner(model, kv_blocks=10, continual_metric=True)
    runner = ModelRunner(model, kv_blocks=10)
    with pytest.raises(InvalidParameterError, match="compress needs a runner built with an eviction preset"):
        runner.compress([runner.new_sequence()], [8])
    with pytest.raises(InvalidParameterError, match="at least one chunk"):
        runner.prefill([])
    with pytest.raises(InvalidParameterError, match="one token per sequence"):
        runner.decode([runner.new_sequence()], [])
