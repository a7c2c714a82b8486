"""Is a quantized format's changed answer the format's doing, or a prompt on a knife's edge?

``kvtrim eval`` sweeps compare each prompt's score with quantized entries against the same prompt with float32
entries. On a small model at a high compression ratio a few answers hang on a logit margin so thin that any
rounding of the kept entries flips them. This script takes the prompts whose score a format changed (read from two
sweep folders of the same draws) and answers each again with the kept entries of the float32 cache rounded to
bfloat16 and to float16 (the dtypes a GPU model holds its cache in) after the same compression, beside float32 and
the quantized format. A prompt that float16 or bfloat16 rounding flips as well is one the format cannot be blamed
for alone: the model's own half-precision cache would change it.

```bash
PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_kvquant_noise_floor.py \
    --draws benchmarks/results/kvquant_harness_1k,benchmarks/results/kvquant_harness_1k_seed7 \
    --baseline none --format int8 --method kvzip --ratio 0.875 --name kvzip_0875_int8
```

Writes ``benchmarks/results/bench_kvquant_noise_floor/NAME.{json,md}``. Every answer is decoded again here
(greedy, each task's own token limit), so the float32 and format columns are this run's, not the sweep's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch

OUT_DIR = Path(__file__).resolve().parent / "results" / "bench_kvquant_noise_floor"
ROUNDINGS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def changed_cases(baseline: list[dict], other: list[dict], method: str, ratio: float | None) -> list[dict]:
    """The context-only prompts of ``method`` at ``ratio`` whose score differs between two record lists of the same
    draw: ``[{task, index, seed, length, baseline, other, meta}]`` in task, index order."""

    def pick(records: list[dict]) -> dict:
        return {
            (r["task"], r["index"], r["seed"], r["length"]): r
            for r in records
            if r.get("method") == method and r.get("ratio") == ratio and r.get("mode") == "context-only"
        }

    a, b = pick(baseline), pick(other)
    out = []
    for key in sorted(a.keys() & b.keys()):
        if a[key]["score"] != b[key]["score"]:
            task, index, seed, length = key
            out.append({"task": task, "index": index, "seed": seed, "length": length, "baseline": a[key]["score"],
                        "other": b[key]["score"], "meta": a[key].get("meta")})  # fmt: skip
    return out


def round_kept_entries(cache, dtype: torch.dtype) -> int:
    """Round every layer's stored keys and values of a float cache to ``dtype`` and back, in place (what holding
    them in that dtype would give attention); returns the entries rounded. Refuses quantized stores."""
    rounded = 0
    for layer in cache.kv_layers:
        store = layer.store
        if store is None:
            continue
        if not hasattr(store, "_k"):
            raise ValueError(f"round_kept_entries: {type(store).__name__} holds no float entries to round")
        for t in (store._k, store._v):
            t.copy_(t.to(dtype).to(t.dtype))
        rounded += store.entries()
    return rounded


def answer(session, sample, method: str, ratio: float, rounding: torch.dtype | None, kv_quant: str | None) -> str:
    """One context-only answer of ``session`` (compressed as the sweep does), with the kept entries rounded to
    ``rounding`` after compression, or held as ``kv_quant``."""
    prefill, original = session.prefill, session.prefill.compressed

    def compressed(*args, **kwargs):
        out = original(*args, **kwargs)
        if rounding is not None:
            round_kept_entries(out.cache, rounding)
        return out

    prefill.compressed = compressed
    try:
        result = session.run(method, ratio=ratio, questions=[sample.question], max_new_tokens=sample.max_new_tokens,
                             kv_quant=kv_quant)  # fmt: skip
    finally:
        del prefill.compressed
    raw = result.answers[0]
    from kvtrim.eval.runner import _cut_newline  # the harness's own cut, so scores compare with the sweep's

    return _cut_newline(raw) if sample.meta.get("stop_on_newline", False) else raw


def render(report: dict) -> list[str]:
    cols = [*ROUNDINGS, report["format"]]
    lines = [
        f"# Noise floor of `{report['format']}`: {report['method']} at ratio {report['ratio']}, {report['date']}",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Prompts whose score `{report['format']}` changed against `{report['baseline']}` in the sweep records, each "
        "answered again here: score with the kept entries as computed (float32), rounded to bfloat16 or float16 "
        "after the same compression, and held in the format.",
        "",
        "| task | index | seed | sweep (baseline → format) | " + " | ".join(cols) + " | rounding flips it too |",
        "|---|---:|---:|---|" + "---:|" * len(cols) + "---|",
    ]
    for c in report["cases"]:
        scores = [c["scores"][k] for k in cols]
        flips = [k for k in ("bfloat16", "float16") if c["scores"][k] != c["scores"]["float32"]]
        lines.append(
            f"| {c['task']} | {c['index']} | {c['seed']} | {c['baseline']:.2f} → {c['other']:.2f} | "
            + " | ".join(f"{s:.2f}" for s in scores)
            + f" | {', '.join(flips) or 'no'} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", required=True, help="comma-separated sweep folders, each with BASELINE/ and FORMAT/")
    ap.add_argument("--baseline", default="none", help="the float folder's name in each draw")
    ap.add_argument("--format", default="int8", help="the quantized folder's name, and the --kv-quant it ran")
    ap.add_argument("--kv-quant", default=None, help="the format's spec if it differs from --format")
    ap.add_argument("--method", default="kvzip")
    ap.add_argument("--ratio", type=float, default=0.875)
    ap.add_argument("--samples", type=int, default=6, help="prompts per task of the sweeps (the draw depends on it)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="results")
    args = ap.parse_args(argv)

    import kvtrim
    from kvtrim.api import Session
    from kvtrim.eval.metrics import score_sample
    from kvtrim.eval.runner import load_records
    from kvtrim.eval.tasks import generate_task

    torch.set_num_threads(args.threads)
    cases = []
    for draw in args.draws.split(","):
        found = changed_cases(
            load_records(Path(draw) / args.baseline), load_records(Path(draw) / args.format), args.method, args.ratio
        )
        cases += [dict(c, draw=draw) for c in found]
    model, tokenizer = kvtrim.load_model("smollm2-135m", dtype="float32", device="cpu")
    for case in cases:
        samples = generate_task(case["task"], tokenizer, case["length"], args.samples, seed=case["seed"])
        sample = next(s for s in samples if s.index == case["index"])
        if case["meta"] is not None and json.loads(json.dumps(sample.meta, default=str)) != case["meta"]:
            raise SystemExit(f"{case}: the regenerated prompt differs from the sweep's (check --samples)")
        session = Session(model, tokenizer, sample.context, methods=[args.method],
                          answer_prefix=sample.answer_prefix or None,
                          use_chat_template=bool(sample.meta.get("chat_template", True)))  # fmt: skip
        answers = {
            name: answer(session, sample, args.method, args.ratio, dtype, None) for name, dtype in ROUNDINGS.items()
        }
        answers[args.format] = answer(session, sample, args.method, args.ratio, None, args.kv_quant or args.format)
        case["answers"] = answers
        case["scores"] = {k: score_sample(sample, v) for k, v in answers.items()}
        print(json.dumps({k: case[k] for k in ("task", "index", "seed", "scores")}), flush=True)
    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/bench_kvquant_noise_floor.py", *(argv or sys.argv[1:])]),
        "threads": args.threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "method": args.method,
        "ratio": args.ratio,
        "baseline": args.baseline,
        "format": args.format,
        "cases": [{k: v for k, v in c.items() if k != "meta"} for c in cases],
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"{args.name}.json").write_text(json.dumps(report, indent=2))
    (OUT_DIR / f"{args.name}.md").write_text("\n".join(render(report)) + "\n")
    print("\n".join(render(report)))


if __name__ == "__main__":
    main()
