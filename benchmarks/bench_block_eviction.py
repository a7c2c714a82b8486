"""CPU time of KV-Compress block eviction on paged sequences of the embedded model: one by one vs. one batch.

``--sequences`` jargon prompts of ``--tokens`` tokens each are prefilled into paged sequences of one pool (each a
different slice of the haystack). Then the per-head budget M steps down from 900 to 116 tokens by 16, and each
step evicts every sequence down to it:

* ``per_sequence``: ``compress_sequence`` on each sequence in turn (what the engine did before batched eviction); the
  block ranking (``schedule_evictions``) and MoveCache (``apply_evictions``) of the first sequence are also timed
  separately, as the earlier version of this benchmark did;
* ``batched``: one ``compress_sequences`` call over all sequences (one ranking and one MoveCache for the batch).

Both modes start from the same prefilled state (the prefill is run once per mode). Times are CPU seconds of this
process (``time.process_time``), one torch thread. Run against code without ``compress_sequences`` (before batched
eviction) only the per-sequence mode runs.

Usage::

    python benchmarks/bench_block_eviction.py [--sequences 8] [--tokens 1000]
        [--out benchmarks/results/bench_block_eviction/block_eviction.json]
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
from kvtrim.selection import block_eviction as be

OUT = Path(__file__).parent / "results" / "bench_block_eviction" / "block_eviction.json"
BUDGETS = list(range(900, 100, -16))


def prefill(model, tokenizer, n: int, tokens: int) -> list[PagedSequence]:
    cfg = model.config
    text = get_haystack("jargon")
    pool = BlockPool(
        n * cfg.num_hidden_layers * cfg.num_key_value_heads * (-(-tokens // 16)) + 16,
        16,
        cfg.hidden_size // cfg.num_attention_heads,
        model.dtype,
    )
    seqs = []
    for i in range(n):
        ids = tokenizer(text[i * 2000 : i * 2000 + 20 * tokens], return_tensors="pt").input_ids[:, :tokens]
        seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
        cache = PagedBatchCache(cfg, pool, [seq], observe_window=32)
        model(ids, past_key_values=cache, use_cache=True)
        be.prefill_metric(cache)
        seqs.append(seq)
    return seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--label", default="", help="free text stored with the result (e.g. the code version)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = kvtrim.load_model("smollm2-135m")
    batched_available = hasattr(be, "compress_sequences")
    result: dict = {"sequences": args.sequences, "tokens": args.tokens, "evictions": len(BUDGETS)}
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        seqs = prefill(model, tokenizer, args.sequences, args.tokens)
        per_seq = schedule_s = apply_s = 0.0
        for budget in BUDGETS:
            first = seqs[0]
            over = be.blocks_over_budget(first, max_cache_tokens=budget)
            t0 = time.process_time()
            plan = be.schedule_evictions(first, blocks_to_evict=over, protected_window=32)
            t1 = time.process_time()
            be.apply_evictions(first, plan)
            t2 = time.process_time()
            schedule_s, apply_s = schedule_s + t1 - t0, apply_s + t2 - t1
            for seq in seqs[1:]:
                be.compress_sequence(seq, max_cache_tokens=budget, protected_window=32)
            per_seq += time.process_time() - t0
        held_per_seq = sum(s.blocks_held() for s in seqs)
        result["per_sequence_ms_per_step"] = 1000 * per_seq / len(BUDGETS)
        result["schedule_evictions_ms_per_call"] = 1000 * schedule_s / len(BUDGETS)
        result["apply_evictions_ms_per_call"] = 1000 * apply_s / len(BUDGETS)
        if batched_available:
            seqs = prefill(model, tokenizer, args.sequences, args.tokens)
            batched = 0.0
            for budget in BUDGETS:
                t0 = time.process_time()
                be.compress_sequences(seqs, max_cache_tokens=[budget] * len(seqs), protected_window=32)
                batched += time.process_time() - t0
            held = sum(s.blocks_held() for s in seqs)
            if held != held_per_seq:
                raise RuntimeError(f"batched eviction kept {held} blocks, one by one {held_per_seq}")
            result["batched_ms_per_step"] = 1000 * batched / len(BUDGETS)
    result.update(label=args.label, torch=torch.__version__)
    n = args.sequences
    lines = [
        f"# Block eviction CPU time ({n} sequences × {args.tokens} tokens, 30 layers × 3 KV heads, "
        f"{len(BUDGETS)} eviction steps)",
        "",
        f"{args.label}",
        "",
        f"- one by one: {result['per_sequence_ms_per_step']:.1f} ms per step "
        f"({result['per_sequence_ms_per_step'] / n:.2f} ms per sequence); first sequence: schedule_evictions "
        f"{result['schedule_evictions_ms_per_call']:.2f} ms, "
        f"apply_evictions {result['apply_evictions_ms_per_call']:.2f} ms",
    ]
    if "batched_ms_per_step" in result:
        lines.append(
            f"- one batch (compress_sequences): {result['batched_ms_per_step']:.1f} ms per step "
            f"({result['batched_ms_per_step'] / n:.2f} ms per sequence)"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
