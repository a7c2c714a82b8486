"""Why CompilerKV misses pass keys on the embedded model: its observation window W (paper: 64).

Question-aware passkey prompts of ~1k tokens, `compilerkv_neutral` (no tables involved) at one budget, W swept.
Writes ``benchmarks/results/bench_compilerkv_window_check/window.json`` and ``window.md``.

Usage::

    python benchmarks/bench_compilerkv_window_check.py --samples 6 --budget 128
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvtrim
from kvtrim.eval.tasks import generate_task

OUT = Path(__file__).parent / "results" / "bench_compilerkv_window_check"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--windows", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvtrim.load_model("smollm2-135m")
    started = time.perf_counter()
    rows = []
    for sample in generate_task("passkey", tokenizer, 1024, args.samples):
        session = kvtrim.Session(
            model, tokenizer, sample.context, sample.question, methods=["compilerkv_neutral"],
            answer_prefix=sample.answer_prefix,
        )
        for window in args.windows:
            params = {"window": window}
            out = session.run("compilerkv_neutral", budget=args.budget, max_new_tokens=8, method_params=params)
            rows.append(
                {"index": sample.index, "window": window, "prediction": out.answers[0], "answer": sample.answers[0],
                 "correct": sample.answers[0] in out.answers[0]}
            )
    lines = [
        f"# CompilerKV (neutral tables) on passkey vs its window W (budget {args.budget}, question-aware)\n",
        f"{args.samples} prompts of ~1,024 tokens (kvtrim passkey, seed 42); {time.perf_counter() - started:.0f} s.\n",
        "| W | correct |", "|---:|---:|",
    ]
    for window in args.windows:
        correct = sum(r["correct"] for r in rows if r["window"] == window)
        lines.append(f"| {window} | {correct}/{args.samples} |")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "window.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    (OUT / "window.md").write_text(text)


if __name__ == "__main__":
    main()
