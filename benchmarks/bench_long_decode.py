"""A 1k-token generation with decoding-time compression vs. the full cache (SmolLM2-135M, CPU).

One ~1k-token prompt (question included in the prefill) is prefilled once; every configuration compresses a
copy and then greedily generates ``--tokens`` tokens with end-of-sequence ignored, so every configuration
decodes the same number of steps:

* ``full``: nothing evicted;
* ``lagkv`` at 4x: recursive, one more partition compressed every 128 generated tokens;
* ``lagkv@prefill``: LagKV applied once after prefill only (the kvpress port's behaviour), the cache then grows;
* ``snapkv@over:0`` / ``streaming_llm@over:0``: a hard cap of ``--budget`` entries per (layer, KV head),
  re-compressed at every step once reached;
* ``snapkv@every:64`` / ``h2o@every:64``: re-compressed to the budget every 64 tokens;
* ``rkv@over:64``: R-KV re-compressed whenever a head holds 64 entries over the budget (the same memory).

Reported: decode milliseconds per token (CPU time of this process, and wall time), key/value bytes held at
the end and at the largest step boundary, number of compressions and the time they took, and how many of the
generated tokens equal the full cache's (and where they first differ).

Usage::

    python benchmarks/bench_long_decode.py             # ~12 min of CPU time
    python benchmarks/bench_long_decode.py --quick     # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path

import torch

import kvtrim
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.methods import get_method
from kvtrim.runtime import Prefill, greedy_decode
from kvtrim.scoring.observation import ObservationSpec

MODEL = "smollm2-135m"


def configs(budget: int) -> list[tuple[str, float | None, int | None]]:
    return [
        ("full", None, None),
        ("lagkv", 0.75, None),
        ("lagkv@prefill", 0.75, None),
        ("snapkv@over:0", None, budget),
        ("streaming_llm@over:0", None, budget),
        ("snapkv@every:64", None, budget),
        ("h2o@every:64", None, budget),
        # R-KV at the memory of snapkv@every:64: between the budget and budget + 64 entries per head
        ("rkv@over:64", None, budget),
        # TriAttention at the same memory
        ("triattention@over:64", None, budget),
    ]


def prompt_ids(tokenizer, length: int):
    from kvtrim.eval.tasks import generate_task
    from kvtrim.prompts import prompt_template

    sample = generate_task("long_copy", tokenizer, length, 1, seed=3)[0]
    template = prompt_template(tokenizer, bool(sample.meta.get("chat_template", True)))
    text = template.context_part(sample.context) + template.question_part(sample.question, sample.answer_prefix)
    return tokenizer(text, return_tensors="pt", add_special_tokens=template.prefix == "")["input_ids"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens to generate")
    parser.add_argument("--budget", type=int, default=512, help="entries per (layer, KV head) for capped configs")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", default=None, metavar="CONFIG",
                        help="run only these configs (full is always run: it is the reference)")
    parser.add_argument("--out", default="benchmarks/results/bench_long_decode/long_decode.json")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.length = 150, 600
    torch.set_num_threads(args.threads)
    model, tokenizer = kvtrim.load_model(MODEL)
    ids = prompt_ids(tokenizer, args.length)
    mask = torch.ones_like(ids)
    observation = ObservationSpec()
    chosen = [c for c in configs(args.budget) if args.only is None or c[0] == "full" or c[0] in args.only]
    unknown = set(args.only or ()) - {c[0] for c in configs(args.budget)}
    if unknown:
        parser.error(f"--only: unknown configs {sorted(unknown)}")
    for name, _, _ in chosen:
        if name != "full":
            observation = observation.merge(get_method(name).observation)
    rows, reference = [], None
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre = Prefill.plain(model, ids, mask, observation)
        for name, ratio, budget in chosen:
            pipeline = None if name == "full" else get_method(name)
            spec = None if pipeline is None else BudgetSpec(ratio=ratio, budget=budget)
            cache = pre.cache.clone(pipeline, spec)
            if pipeline is not None:
                cache.compress()
            after_prefill = cache.stats().kv_bytes
            cpu0 = time.process_time()
            outcome = greedy_decode(model, cache, pre.mask, pre.logits, args.tokens + 1, set(), -1)
            cpu = time.process_time() - cpu0
            tokens = outcome.tokens[0]
            if reference is None:
                reference = tokens
            same = sum(a == b for a, b in zip(tokens, reference, strict=False))
            first_diff = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), None)
            reports = cache.reports[1:]  # decoding-time compressions only
            row = {
                "config": name,
                "ratio": ratio,
                "budget": budget,
                "decode_steps": outcome.steps,
                "decode_cpu_ms_per_token": round(1000 * cpu / outcome.steps, 2),
                "decode_wall_ms_per_token": round(1000 * outcome.seconds / outcome.steps, 2),
                "kv_bytes_after_prefill": after_prefill,
                "kv_bytes_end": cache.stats().kv_bytes,
                "kv_entries_end": cache.stats().entries,
                "peak_kv_bytes": max(cache.peak_kv_bytes, cache.stats().kv_bytes),
                "decode_compressions": len(reports),
                "decode_compress_s": round(sum(r.seconds for r in reports), 3),
                "tokens_equal_to_full": same,
                "first_difference": first_diff,
                "text_head": tokenizer.decode(tokens[:40]),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            del cache
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "threads": args.threads,
        "prompt_tokens": int(ids.shape[1]),
        "generated_tokens": args.tokens,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    md = _markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)


def _markdown(result: dict) -> str:
    mib = 2**20
    lines = [
        "# Long generation with decoding-time compression (SmolLM2-135M, CPU)",
        "",
        f"Run {result['date']}, {result['threads']} torch thread(s); prompt {result['prompt_tokens']} tokens "
        f"(a long_copy prompt, question included), {result['generated_tokens']} tokens generated greedily with "
        "end-of-sequence ignored. ms/token is CPU time of the process divided by decoding steps (wall time next "
        "to it); decoding-time compression time is included in both. Peak K/V is the largest size held at a step "
        "boundary, the uncompressed prompt before its first compression included.",
        "",
        "| config | ratio | budget | CPU ms/token | wall ms/token | K/V MiB after prefill | K/V MiB at end "
        "| peak K/V MiB (incl. prompt) | decode compressions | their time s | tokens = full | first difference |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['config']} | {r['ratio'] if r['ratio'] is not None else ''} | {r['budget'] or ''} "
            f"| {r['decode_cpu_ms_per_token']:.1f} | {r['decode_wall_ms_per_token']:.1f} "
            f"| {r['kv_bytes_after_prefill'] / mib:.1f} | {r['kv_bytes_end'] / mib:.1f} "
            f"| {r['peak_kv_bytes'] / mib:.1f} "
            f"| {r['decode_compressions']} | {r['decode_compress_s']:.2f} | {r['tokens_equal_to_full']} "
            f"| {'' if r['first_difference'] is None else r['first_difference']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
