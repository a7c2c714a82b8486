"""Blocks a per-head method frees inside vLLM against the uniform method at the same mean budget.

Per-head methods (AdaKV) keep ``min(B + block_size − 1, prompt)`` slots of vLLM's block list, so that any split
of ``kv_heads · B`` entries among a layer's heads fits in one-head sub-pages (``kvtrim.vllm.subpages``); the
uniform method (SnapKV, same SnapKV scores) keeps ``B``. Each configuration runs ``--requests`` prompts of
``--prompt-len`` deterministic token ids through ``vllm.LLM`` (SmolLM2-135M, float32, eager) and reads the blocks
the scheduler returned to vLLM's pool (``SchedulerState.blocks_freed``), the (request, layer) pairs whose heads
kept different counts, the blocks still in use after the run (must be 0) and the wall time of the generate call.

``--params`` passes the per-head method's own parameters (a JSON object), e.g. KV-Compress's
``--method kvcompress --params '{"even_layer_evict": true}'``; the uniform method runs with its defaults.

Results go to ``benchmarks/results/bench_vllm_head_blocks/``. Run it in ``.venv-vllm``::

    .venv-vllm/bin/python benchmarks/bench_vllm_head_blocks.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import numpy as np

MODEL_DIR = Path.home() / ".cache" / "kvtrim" / "models" / "smollm2-135m"
OUT_DIR = Path(__file__).parent / "results" / "bench_vllm_head_blocks"


def run(
    method: str, budget: int, block_size: int, prompts: list[list[int]], output_len: int, params: dict | None = None
) -> dict:
    from vllm.inputs import TokensPrompt

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(MODEL_DIR),
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=16,
        seed=0,
        block_size=block_size,
        additional_config={"kvtrim": {"method": method, "budget": budget, "params": dict(params or {})}},
    )
    core = llm.llm_engine.engine_core.engine_core
    try:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        state = core.scheduler._kvtrim_state
        worker = core.model_executor.driver_worker.worker.model_runner._kvtrim_state
        pool = core.scheduler.kv_cache_manager.block_pool
        return {
            "method": method,
            "budget": budget,
            "block_size": block_size,
            "blocks_freed": state.blocks_freed,
            "requests_compressed": state.requests_compressed,
            "ragged_layers": worker.ragged_layers,
            "layers": worker.num_layers,
            "blocks_in_use_after": pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
            "wall_s": round(wall, 2),  # prefill and decode of all prompts, submitted at once
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--budgets", default="128,256")
    parser.add_argument("--block-sizes", default="32,128")
    parser.add_argument("--method", default="adakv")
    parser.add_argument("--uniform", default="snapkv")
    parser.add_argument("--params", default="{}", help="the per-head method's parameters, a JSON object")
    parser.add_argument("--name", default="results")
    args = parser.parse_args()
    params = json.loads(args.params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(200, 20000, size=args.prompt_len).tolist() for _ in range(args.requests)]
    rows = []
    for block_size in [int(b) for b in args.block_sizes.split(",")]:
        for budget in [int(b) for b in args.budgets.split(",")]:
            pair = {
                args.method: run(args.method, budget, block_size, prompts, args.output_len, params),
                args.uniform: run(args.uniform, budget, block_size, prompts, args.output_len),
            }
            ratio = pair[args.method]["blocks_freed"] / max(pair[args.uniform]["blocks_freed"], 1)
            rows.append({"per_head": pair[args.method], "uniform": pair[args.uniform], "ratio": ratio})
            print(json.dumps(rows[-1]), flush=True)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.date.today().isoformat(), "args": vars(args), "model": MODEL_DIR.name}
    (OUT_DIR / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Blocks freed, {args.method} vs {args.uniform}, {args.requests} prompts of {args.prompt_len} tokens",
        "",
        f"`.venv-vllm/bin/python benchmarks/bench_vllm_head_blocks.py {shlex.join(sys.argv[1:])}` ({meta['date']})",
        "",
        f"| block size | budget | {args.uniform} freed | {args.method} freed | ratio | ragged (request, layer) pairs "
        f"| {args.uniform} wall s | {args.method} wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ph, un = r["per_head"], r["uniform"]
        lines.append(
            f"| {ph['block_size']} | {ph['budget']} | {un['blocks_freed']} | {ph['blocks_freed']} | "
            f"{r['ratio']:.3f} | {ph['ragged_layers']} of {ph['requests_compressed'] * ph['layers']} | "
            f"{un['wall_s']} | {ph['wall_s']} |"
        )
    (OUT_DIR / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
