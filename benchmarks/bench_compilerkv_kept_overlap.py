"""How much the compiled CompilerKV tables change the kept token set, vs. the neutral tables (embedded model).

Jargon File windows (as `bench_compilerkv_nll.py`), one prefill each; per layer, the Jaccard overlap of the positions
kept by `compilerkv` and `compilerkv_neutral` (and, for scale, `compilerkv` vs `snapkv`'s first KV head).
Writes ``benchmarks/results/bench_compilerkv_kept_overlap/kept_overlap.json`` and ``kept_overlap.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import kvtrim
from bench_fidelity import windows
from kvtrim.eval.fidelity import prefill
from kvtrim.eval.haystacks import get_haystack
from kvtrim.methods import get_method

OUT = Path(__file__).parent / "results" / "bench_compilerkv_kept_overlap"


def kept_sets(pre, model, method: str, budget: int) -> list[set[int]]:
    pipeline = get_method(method).bind(model)
    cache = pre.compressed_cache(pipeline, budget=budget)
    out = []
    for layer in cache.kv_layers:
        pos = layer.store.to_dense().positions if layer.store.layout != "dense" else layer.store.positions
        row = pos[0, 0]
        out.append(set(row[row >= 0].tolist()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--budgets", default="64,128,256")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = kvtrim.load_model("smollm2-135m")
    budgets = [int(b) for b in args.budgets.split(",")]
    methods = ["compilerkv", "compilerkv_neutral", "snapkv"]
    rows = []
    with torch.inference_mode():
        for start, ids in windows(tokenizer, get_haystack("jargon"), args.windows, 1000):
            pre = prefill(model, ids, methods)
            for budget in budgets:
                sets = {m: kept_sets(pre, model, m, budget) for m in methods}
                for other in ("compilerkv_neutral", "snapkv"):
                    jac = [len(a & b) / len(a | b) for a, b in zip(sets["compilerkv"], sets[other], strict=True)]
                    rows.append({"window": start, "budget": budget, "other": other, "jaccard_per_layer": jac})
    lines = ["| budget | compiled vs neutral tables | compilerkv vs snapkv (KV head 0) |", "|---:|---:|---:|"]
    for budget in budgets:
        cells = []
        for other in ("compilerkv_neutral", "snapkv"):
            chosen = [r for r in rows if r["budget"] == budget and r["other"] == other]
            values = [statistics.fmean(r["jaccard_per_layer"]) for r in chosen]
            cells.append(f"{statistics.fmean(values):.3f}")
        lines.append(f"| {budget} | " + " | ".join(cells) + " |")
    text = (
        f"# Jaccard overlap of kept positions, mean over layers and {args.windows} jargon windows (1,000 tokens)\n\n"
        + "\n".join(lines) + "\n"
    )
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "kept_overlap.json").write_text(json.dumps({"args": vars(args), "rows": rows}) + "\n")
    (OUT / "kept_overlap.md").write_text(text)


if __name__ == "__main__":
    main()
