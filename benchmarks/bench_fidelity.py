"""Fidelity of every compression method on the embedded SmolLM2-135M model (CPU).

For each window of jargon text (context 512 tokens, continuation 64 tokens), the context is prefilled once,
recording what every method needs; then each method compresses a copy at ratios 0.5 / 0.75 / 0.9 and we
measure, against the full cache (see :mod:`kvtrim.eval.fidelity`):

* ``ΔNLL``: teacher-forced NLL of the continuation, compressed minus full (nats per token);
* ``KL``: mean over continuation positions of ``KL(p_full || p_compressed)`` (nats);
* ``layer rel err`` / ``layer L1``: per-layer attention-output error after ``o_proj`` for the first 16
  decoding queries (same queries and new keys/values for both caches), averaged over layers.

Values are averaged over ``--windows`` windows taken at evenly spaced offsets of the jargon file.

Usage::

    python benchmarks/bench_fidelity.py                 # 4 windows (~2-4 min on 2 CPU cores)
    python benchmarks/bench_fidelity.py --windows 1     # quick look

Writes ``benchmarks/results/bench_fidelity/fidelity.json`` (every measurement) and ``fidelity.md`` (the table,
also printed).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import torch

import kvtrim
from kvtrim.eval.fidelity import continuation_fidelity, prefill
from kvtrim.eval.haystacks import get_haystack

MODEL = "smollm2-135m"
RATIOS = (0.5, 0.75, 0.9)
OUT = Path(__file__).parent / "results" / "bench_fidelity"


def windows(tokenizer, text: str, count: int, length: int) -> list[tuple[int, list[int]]]:
    """``count`` token windows of ``length`` ids, starting at line starts evenly spaced through ``text``."""
    out = []
    step = max(1, (len(text) - 20 * length) // max(count, 1))
    for i in range(count):
        start = text.index("\n", i * step) + 1 if i else 0
        ids = tokenizer(text[start : start + 20 * length], add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            raise RuntimeError(f"window at character {start} has only {len(ids)} tokens")
        out.append((start, ids[:length]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--layer-queries", type=int, default=16)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared CPU)")
    parser.add_argument("--out", type=Path, default=OUT / "fidelity.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvtrim.load_model(MODEL)
    text = get_haystack("jargon")
    methods = kvtrim.method_names()
    started = time.perf_counter()
    rows = []
    for start, ids in windows(tokenizer, text, args.windows, args.context + args.continuation):
        ctx, cont = ids[: args.context], ids[args.context :]
        pre = prefill(model, ctx, methods)
        for method in methods:
            for ratio in RATIOS:
                r = continuation_fidelity(
                    model, None, None, cont, method, ratio=ratio, full=pre, layer_queries=args.layer_queries
                )
                row = r.as_dict()
                errors = row.pop("layer_errors")  # keep per-layer values, not the per-head arrays
                row["layer_errors"] = {k: errors[k] for k in ("mean_rel_fro", "mean_l1", "rel_fro", "l1")}
                row["window_start_char"] = start
                rows.append(row)
        print(f"window at char {start}: nll_full={rows[-1]['nll_full']:.3f} ({time.perf_counter() - started:.0f}s)")

    def mean(method: str, ratio: float, key: str, sub: str | None = None) -> float:
        values = [r[key][sub] if sub else r[key] for r in rows if r["method"] == method and r["ratio"] == ratio]
        return statistics.fmean(values)

    header = (
        "| method | ratio | kept | ΔNLL (nats/token) | KL mean | KL first | layer rel err | layer L1 |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for method in methods:
        for ratio in RATIOS:
            lines.append(
                f"| {method} | {ratio} | {mean(method, ratio, 'kept_fraction'):.3f} "
                f"| {mean(method, ratio, 'delta_nll'):+.4f} | {mean(method, ratio, 'kl_mean'):.4f} "
                f"| {mean(method, ratio, 'kl_first'):.4f} "
                f"| {mean(method, ratio, 'layer_errors', 'mean_rel_fro'):.3f} "
                f"| {mean(method, ratio, 'layer_errors', 'mean_l1'):.2f} |"
            )
    nll_full = statistics.fmean({r["window_start_char"]: r["nll_full"] for r in rows}.values())
    elapsed = time.perf_counter() - started
    intro = (
        f"# Fidelity of compression methods ({MODEL}, jargon text)\n\n"
        f"Context {args.context} tokens, continuation {args.continuation} tokens (teacher-forced), layer errors "
        f"over the first {args.layer_queries} decoding queries; mean over {args.windows} window(s). "
        f"Full-cache NLL: {nll_full:.3f} nats/token. Generated {dt.date.today().isoformat()} in {elapsed:.0f}s "
        f"(torch {torch.__version__}, {args.threads} thread(s)).\n\n"
        "ΔNLL = NLL(compressed) − NLL(full); KL = mean over continuation positions of KL(p_full ‖ p_compressed) "
        "(position 0 is predicted before compression, so it counts as 0); KL first = KL at the first prediction "
        "made from the compressed cache; layer rel err = ‖o_comp − o_full‖_F / ‖o_full‖_F and layer L1 = "
        "per-query ‖o_comp − o_full‖₁ of each layer's attention output after o_proj (same queries and new "
        "keys/values for both caches), averaged over layers.\n\n"
    )
    table = intro + "\n".join(lines) + "\n"
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": MODEL,
        "haystack": "jargon",
        "context": args.context,
        "continuation": args.continuation,
        "layer_queries": args.layer_queries,
        "windows": args.windows,
        "ratios": list(RATIOS),
        "methods": methods,
        "threads": args.threads,
        "torch": torch.__version__,
        "seconds": elapsed,
    }
    body = ",\n".join(json.dumps(row) for row in rows)  # one measurement per line
    args.out.write_text(f'{{"meta": {json.dumps(meta)},\n"rows": [\n{body}\n]}}\n')
    args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
