"""Bytes held by a KV-Compress paged sequence vs. the bytes of the entries it stores (embedded model, CPU).

One jargon prompt of ``--tokens`` tokens is prefilled into a fresh paged sequence per compression rate, compressed
with KV-Compress (M = ⌊(T/cr − 1)/16⌋·16 per head on average, at least 16; protected window 32), then decoded
``--decode`` greedy steps with continual compression. Bytes are measured from the pool: blocks held × block bytes
against entries × 2 × head_dim × 4; the invariant is at most one partial block of slack per (layer, KV head).

Usage::

    python benchmarks/bench_paged_bytes.py --tokens 1000 --decode 20

Writes ``benchmarks/results/bench_paged_bytes/paged_bytes.json`` and ``paged_bytes.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvtrim
from kvtrim.cache.paged import BlockPool, PagedBatchCache, PagedSequence
from kvtrim.eval.haystacks import get_haystack
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.selection.block_eviction import compress_sequence, prefill_metric

OUT = Path(__file__).parent / "results" / "bench_paged_bytes"


def measure(seq: PagedSequence, pool: BlockPool, label: str, rate: float, elapsed: float) -> dict:
    lengths = seq.lengths().float()
    rows = lengths.numel()
    held, stored = seq.held_nbytes(), seq.kv_nbytes()
    return {
        "state": label,
        "rate": rate,
        "entries": seq.entries(),
        "blocks": seq.blocks_held(),
        "bytes_held": held,
        "entry_bytes": stored,
        "slack_bytes": held - stored,
        "slack_limit_bytes": rows * (pool.block_size - 1) * pool.block_nbytes() // pool.block_size,
        "per_head_min": int(lengths.min()),
        "per_head_mean": float(lengths.mean()),
        "per_head_max": int(lengths.max()),
        "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--decode", type=int, default=20)
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 2, 8, 32])
    parser.add_argument("--protected-window", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT / "paged_bytes.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvtrim.load_model("smollm2-135m")
    cfg = model.config
    ids = tokenizer(get_haystack("jargon")[:20 * args.tokens], add_special_tokens=False, return_tensors="pt")
    ids = ids.input_ids[:, : args.tokens]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rows = []
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        for rate in args.rates:
            pool = BlockPool(32768, 16, head_dim, model.dtype)
            seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
            t0 = time.perf_counter()
            cache = PagedBatchCache(cfg, pool, [seq], observe_window=32)
            logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
            prefill_metric(cache)
            rows.append(measure(seq, pool, "prefill", rate, time.perf_counter() - t0))
            budget = max(16, int((args.tokens / rate - 1) // 16) * 16)
            if rate > 1:
                t0 = time.perf_counter()
                compress_sequence(seq, max_cache_tokens=budget, protected_window=args.protected_window)
                rows.append(measure(seq, pool, f"compressed (M={budget})", rate, time.perf_counter() - t0))
            t0 = time.perf_counter()
            for _ in range(args.decode):
                cache = PagedBatchCache(cfg, pool, [seq], accumulate_decode_metric=True)
                token = logits.argmax(-1, keepdim=True)
                logits = model(token, past_key_values=cache, position_ids=torch.tensor([[seq.seen]])).logits[:, -1]
                if rate > 1:
                    compress_sequence(seq, max_cache_tokens=budget, protected_window=args.protected_window)
            rows.append(measure(seq, pool, f"after {args.decode} decode steps", rate, time.perf_counter() - t0))
            assert all(r["slack_bytes"] <= r["slack_limit_bytes"] for r in rows)
            seq.release()
            assert pool.num_free == pool.num_blocks
    lines = [
        f"# Bytes held by a paged KV-Compress sequence (smollm2-135m, {args.tokens}-token jargon prompt)\n",
        "Slack = bytes held − entry bytes; the limit is one partial block (15 slots) per (layer, KV head). "
        f"Protected window {args.protected_window}; after decoding, continual compression each step.\n",
        "| rate | state | entries | blocks | bytes held | entry bytes | slack | slack limit | per-head min/mean/max |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']:g} | {r['state']} | {r['entries']:,} | {r['blocks']:,} | {r['bytes_held']:,} | "
            f"{r['entry_bytes']:,} | {r['slack_bytes']:,} | {r['slack_limit_bytes']:,} | "
            f"{r['per_head_min']} / {r['per_head_mean']:.1f} / {r['per_head_max']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
