"""CPU time of KV-Compress block eviction on one paged sequence of the embedded model.

A 1,000-token jargon prompt is prefilled into a paged sequence; then the per-head budget M steps down from 900 to
116 tokens by 16, and each step evicts down to it: ``schedule_evictions`` (the block ranking) and
``apply_evictions`` (MoveCache and freeing) are timed separately with ``time.process_time``.

Usage::

    python benchmarks/bench_block_eviction.py [--out benchmarks/results/block_eviction/block_eviction.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvtrim
from kvtrim.cache.paged import BlockPool, PagedBatchCache, PagedSequence, prefill_metric
from kvtrim.eval.haystacks import get_haystack
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.selection.block_eviction import apply_evictions, blocks_over_budget, schedule_evictions

OUT = Path(__file__).parent / "results" / "block_eviction" / "block_eviction.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = kvtrim.load_model("smollm2-135m")
    cfg = model.config
    ids = tokenizer(get_haystack("jargon")[: 20 * args.tokens], return_tensors="pt").input_ids[:, : args.tokens]
    pool = BlockPool(32768, 16, cfg.hidden_size // cfg.num_attention_heads, model.dtype)
    seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
    schedule_s = apply_s = 0.0
    budgets = list(range(900, 100, -16))
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        cache = PagedBatchCache(cfg, pool, [seq], observe_window=32)
        model(ids, past_key_values=cache, use_cache=True)
        prefill_metric(cache)
        for budget in budgets:
            over = blocks_over_budget(seq, max_cache_tokens=budget)
            t0 = time.process_time()
            plan = schedule_evictions(seq, blocks_to_evict=over, protected_window=32)
            t1 = time.process_time()
            apply_evictions(seq, plan)
            schedule_s += t1 - t0
            apply_s += time.process_time() - t1
    result = {
        "tokens": args.tokens,
        "evictions": len(budgets),
        "schedule_ms_per_call": 1000 * schedule_s / len(budgets),
        "apply_ms_per_call": 1000 * apply_s / len(budgets),
        "torch": torch.__version__,
    }
    text = (
        f"# Block eviction CPU time ({args.tokens}-token sequence, 30 layers × 3 KV heads, "
        f"{len(budgets)} evictions)\n\n"
        f"schedule_evictions: {result['schedule_ms_per_call']:.2f} ms per call; "
        f"apply_evictions: {result['apply_ms_per_call']:.2f} ms per call\n"
    )
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
