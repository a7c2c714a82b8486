"""Decode speed and bytes held: ragged per-head storage vs dense storage at equal total entries.

AdaKV keeps a different number of entries per KV head (ragged storage, exact bytes); SnapKV at the same ratio
keeps the same total number of entries, uniformly (dense storage). AdaKV forced into the dense layout pads every
head to the widest one (what a masking implementation would hold at best). All three decode the same number of
tokens from the same prefill.

    .venv/bin/python benchmarks/bench_ragged_decode.py [--tokens 2048] [--steps 64] [--ratios 0.5,0.75,0.875]
        [--threads 1] [--timer cpu|wall] [--reps 3]

``--timer cpu`` (default) times each step with the process's CPU time, which other jobs on a shared machine do
not inflate (use it with ``--threads 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

import kvtrim
from kvtrim.eval.tasks import generate_task
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.runtime import feed

CONFIGS = [
    ("snapkv", "dense (uniform per head)", {}),
    ("adakv", "ragged (per-head counts)", {}),
    ("adakv", "dense, padded to widest head", {"layout": "dense"}),
]


def decode_ms(model, cache, mask, first_token: torch.Tensor, steps: int, clock=time.process_time) -> float:
    """Median ms per single-token forward over ``steps`` greedy steps (after 4 warm-up steps)."""
    token, times = first_token.view(1, 1), []
    for step in range(steps + 4):
        t0 = clock()
        fed = feed(model, cache, mask, token, torch.ones(1, 1, dtype=mask.dtype))
        logits, mask = fed.logits, fed.mask
        if step >= 4:
            times.append(clock() - t0)
        token = logits.argmax(-1).view(1, 1)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--ratios", default="0.5,0.75,0.875")
    parser.add_argument("--out", default="benchmarks/results/bench_ragged_decode/ragged_decode.json")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3, help="round-robin repetitions (median reported)")
    parser.add_argument("--timer", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.timer == "cpu" else time.perf_counter
    model, tok = kvtrim.load_model("smollm2-135m")
    sample = generate_task("passkey", tok, args.tokens, 1, seed=0)[0]
    session = kvtrim.Session(model, tok, sample.context, methods=["snapkv", "adakv"])
    pre = session.prefill
    configs = [("full", "dense", {}, 0.0)]
    configs += [(m, label, o, float(r)) for r in args.ratios.split(",") for m, label, o in CONFIGS]
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        first = pre.logits.argmax(-1)
        compressed = []
        for method, _label, overrides, ratio in configs:
            if method == "full":
                compressed.append((None, None, pre.cache.clone(None, None)))
                continue
            pipeline = kvtrim.get_method(method)
            for key, value in overrides.items():
                setattr(pipeline, key, value)
            spec = kvtrim.BudgetSpec(ratio=ratio)
            cache = pre.cache.clone(pipeline, spec)
            cache.compress()
            compressed.append((pipeline, spec, cache))
        # Round-robin: every configuration once per repetition, each time from a fresh copy of its compressed cache,
        # so slow drifts of a shared machine spread over all of them; the median over repetitions is reported.
        times: list[list[float]] = [[] for _ in configs]
        for _ in range(args.reps):
            for i, (pipeline, spec, cache) in enumerate(compressed):
                times[i].append(decode_ms(model, cache.clone(pipeline, spec), pre.mask, first, args.steps, clock))
        rows = []
        for (method, label, _, ratio), (_, _, cache), ms in zip(configs, compressed, times, strict=True):
            stats = cache.stats()
            rows.append(
                {
                    "method": method,
                    "layout": label,
                    "store_layouts": sorted({layer.store.layout for layer in cache.layers}),
                    "ratio": ratio,
                    "entries": stats.entries,
                    "kv_bytes": stats.kv_bytes,
                    "decode_ms": statistics.median(ms),
                    "decode_ms_reps": ms,
                }
            )
            print(rows[-1], flush=True)
    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "context_tokens": session.context_tokens_per_row[0],
        "steps": args.steps,
        "timer": args.timer,
        "reps": args.reps,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "load_average": list(os.getloadavg()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [
        f"context {env['context_tokens']} tokens, {args.steps} decode steps x {args.reps} round-robin repetitions "
        f"(median), {args.timer} time per step "
        f"({env['threads']} thread), load average {env['load_average']}",
        "",
        "| method | storage | ratio | entries | KV MiB | decode ms/token |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['layout']} | {r['ratio']} | {r['entries']} | {r['kv_bytes'] / 2**20:.2f} "
            f"| {r['decode_ms']:.1f} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
