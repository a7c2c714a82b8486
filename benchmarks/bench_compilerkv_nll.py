"""Held-out continuation NLL of CompilerKV, its ablations and the baselines on the embedded model (CPU).

Windows of the Jargon File (the harness haystack; disjoint from the `pydoc` calibration corpus): a context of
``--context`` tokens is prefilled once, every method compresses a copy at each budget (entries per layer and KV
head), and the teacher-forced NLL of the next ``--continuation`` tokens is compared with the full cache (the
quantity CompilerKV's compiler optimizes). Elastic variants may keep fewer entries: the kept fraction is reported.

Usage::

    python benchmarks/bench_compilerkv_nll.py --windows 12 --threads 1

Writes ``benchmarks/results/bench_compilerkv_nll/nll.json`` and ``nll.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import kvtrim
from bench_fidelity import windows
from kvtrim.eval.fidelity import continuation_fidelity, prefill
from kvtrim.eval.haystacks import get_haystack

MODEL = "smollm2-135m"
METHODS = (
    "compilerkv",
    "compilerkv_neutral",
    "compilerkv_raw_attention",
    "compilerkv_elastic",
    "compilerkv_neutral_elastic",
    "compilerkv_static_threshold",
    "snapkv",
    "pyramidkv",
    "adakv",
)
OUT = Path(__file__).parent / "results" / "bench_compilerkv_nll"
# (method, reference): paired ΔNLL differences over the same windows
PAIRS = (
    ("compilerkv", "compilerkv_neutral"),
    ("compilerkv_elastic", "compilerkv_neutral_elastic"),
    ("compilerkv_elastic", "compilerkv_static_threshold"),
    ("compilerkv_raw_attention", "compilerkv"),
    ("compilerkv", "snapkv"),
)


def paired_table(rows: list[dict], budgets: list[int]) -> str:
    """Mean paired ΔNLL difference (method − reference) ± its standard error, and windows where the method wins."""

    def per_window(method: str, budget: int) -> dict:
        return {r["window_start_char"]: r for r in rows if r["method"] == method and r["budget"] == budget}

    lines = ["| method − reference | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for method, reference in PAIRS:
        cells = []
        for b in budgets:
            x, y = per_window(method, b), per_window(reference, b)
            if not x or not y:
                cells.append("–")
                continue
            diff = [x[k]["delta_nll"] - y[k]["delta_nll"] for k in x]
            kept = statistics.fmean(x[k]["kept_fraction"] - y[k]["kept_fraction"] for k in x)
            se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else float("nan")
            wins = sum(d < 0 for d in diff)
            mean = statistics.fmean(diff)
            cells.append(f"{mean:+.4f} ± {se:.4f} ({wins}/{len(diff)} better; kept {100 * kept:+.1f} pt)")
        lines.append(f"| {method} − {reference} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--budgets", default="64,128,256")
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT / "nll.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    model, tokenizer = kvtrim.load_model(MODEL)
    text = get_haystack("jargon")
    started, cpu0 = time.perf_counter(), time.process_time()
    rows = []
    for start, ids in windows(tokenizer, text, args.windows, args.context + args.continuation):
        ctx, cont = ids[: args.context], ids[args.context :]
        pre = prefill(model, ctx, methods)
        for method in methods:
            for budget in budgets:
                r = continuation_fidelity(model, None, None, cont, method, budget=budget, full=pre, per_position=False)
                row = {k: v for k, v in r.as_dict().items() if k not in ("layer_errors",)}
                row.update({"budget": budget, "window_start_char": start})
                rows.append(row)
        print(f"window at char {start}: nll_full={rows[-1]['nll_full']:.3f} ({time.perf_counter() - started:.0f}s)")

    def mean(method: str, budget: int, key: str) -> float:
        return statistics.fmean(r[key] for r in rows if r["method"] == method and r["budget"] == budget)

    def sem(method: str, budget: int, key: str) -> float:
        values = [r[key] for r in rows if r["method"] == method and r["budget"] == budget]
        return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")

    lines = ["| method | " + " | ".join(f"B={b}: ΔNLL ± s.e. (kept)" for b in budgets) + " |"]
    lines.append("|---|" + "---|" * len(budgets))
    for method in methods:
        cells = [
            f"{mean(method, b, 'delta_nll'):+.4f} ± {sem(method, b, 'delta_nll'):.4f} "
            f"({100 * mean(method, b, 'kept_fraction'):.1f} %)"
            for b in budgets
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    nll_full = statistics.fmean({r["window_start_char"]: r["nll_full"] for r in rows}.values())
    elapsed = time.perf_counter() - started
    intro = (
        f"# Held-out continuation NLL ({MODEL}, jargon text)\n\n"
        f"Context {args.context} tokens, continuation {args.continuation} tokens (teacher-forced), mean over "
        f"{args.windows} windows; full-cache NLL {nll_full:.3f} nats/token. ΔNLL = NLL(compressed) − NLL(full); "
        "s.e. = standard error over windows; kept = entries kept / entries before. "
        f"{elapsed:.0f} s wall, {time.process_time() - cpu0:.0f} s CPU, {args.threads} thread(s).\n\n"
    )
    table = intro + "\n".join(lines) + "\n\n## Paired differences (same windows)\n\n" + paired_table(rows, budgets)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": MODEL,
        "context": args.context,
        "continuation": args.continuation,
        "windows": args.windows,
        "budgets": budgets,
        "methods": methods,
        "threads": args.threads,
        "seconds": elapsed,
    }
    body = ",\n".join(json.dumps(row) for row in rows)
    args.out.write_text(f'{{"meta": {json.dumps(meta)},\n"rows": [\n{body}\n]}}\n')
    args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
