"""SnapKV's observation window on the embedded model: why kvtrim's ``snapkv`` defaults to w=8 (docs/methods.md).

Passkey prompts of ~600 tokens, question-aware, ratio 0.5; each prompt is prefilled once in a
:class:`kvtrim.Session` and every configuration compresses its own copy:

* ``snapkv w=8`` (kvtrim's default, KVCache-Factory's run config: max-pool k=7),
* ``snapkv w=32`` (the paper's window, max-pool k=7),
* ``snapkv w=64 avg k=5`` (kvpress's SnapKV settings),
* ``tova`` (the last query only), and the full cache.

Usage::

    .venv/bin/python benchmarks/bench_snapkv_window.py --threads 1        # 12 prompts
    .venv/bin/python benchmarks/bench_snapkv_window.py --samples 2        # smoke run

Writes ``benchmarks/results/bench_snapkv_window/snapkv_window.json`` (every answer) and ``.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import kvtrim
from kvtrim.eval.metrics import METRICS
from kvtrim.eval.tasks import generate_task

CONFIGS = [
    ("full", None, {}),
    ("snapkv w=8", "snapkv", {"window": 8}),
    ("snapkv w=32", "snapkv", {"window": 32}),
    ("snapkv w=64 avg k=5", "snapkv", {"window": 64, "kernel": 5, "pooling": "avg"}),
    ("tova", "tova", {}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--length", type=int, default=600)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_snapkv_window/snapkv_window.json"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    model, tokenizer = kvtrim.load_model("smollm2-135m")
    samples = generate_task("passkey", tokenizer, args.length, args.samples, seed=args.seed)
    methods = [kvtrim.get_method(m, **p) for _, m, p in CONFIGS if m]
    records = []
    for index, sample in enumerate(samples):
        session = kvtrim.Session(
            model, tokenizer, sample.context, question=sample.question, methods=methods,
            answer_prefix=sample.answer_prefix or None,
        )  # fmt: skip
        for label, method, params in CONFIGS:
            res = session.run(
                method, ratio=None if method is None else args.ratio, method_params=params or None,
                max_new_tokens=sample.max_new_tokens,
            )  # fmt: skip
            score = METRICS[sample.metric](res.answers[0], sample.answers)
            records.append({"config": label, "index": index, "answer": res.answers[0], "score": score})
    table = ["| configuration | passkeys answered |", "|---|---:|"]
    for label, _, _ in CONFIGS:
        hits = sum(r["score"] == 1.0 for r in records if r["config"] == label)
        table.append(f"| {label} | {hits}/{len(samples)} |")
    meta = {
        "command": "python benchmarks/bench_snapkv_window.py " + " ".join(
            f"--{k} {v}" for k, v in (("samples", args.samples), ("length", args.length), ("ratio", args.ratio),
                                      ("seed", args.seed), ("threads", args.threads)) if v is not None
        ),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.time() - started, 1),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "question_aware": True,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    text = (
        f"# SnapKV's window on SmolLM2-135M-Instruct\n\n`{meta['command']}` ({meta['date']}, {meta['seconds']} s): "
        f"{len(samples)} passkey prompts of ~{args.length} tokens, question-aware, ratio {args.ratio}.\n\n"
        + "\n".join(table)
        + "\n"
    )
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
