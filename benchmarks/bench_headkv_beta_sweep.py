"""Sweep HeadKV's β (and a few temperatures) on the embedded model: decision 9 (docs/decisions.md).

For every sample (passkey and RULER niah_single_2 at ~1k tokens, context-only compression) the context is
prefilled once in a :class:`kvtrim.Session`; each configuration compresses a copy of that cache and answers:

* ``full``: no compression;
* ``uniform``: the same scorer and selector with uniform budgets (SnapKV at w=8, k=7, max-pool);
* ``headkv β=…``: :class:`~kvtrim.budgets.head_scores.HeadScoreBudget` from the shipped ``headkv`` artifact
  (retrieval–reasoning scores), β ∈ {1.005, 1.01, 1.1, 1.2, 1.5, 2, 5}, temperature 1;
* ``--temperatures``: extra temperatures at ``--temperature-beta``.

Usage::

    .venv/bin/python benchmarks/bench_headkv_beta_sweep.py --threads 1   # ~15 min on a shared 2-core CPU
    .venv/bin/python benchmarks/bench_headkv_beta_sweep.py --samples 1 --quick  # smoke run
    .venv/bin/python benchmarks/bench_headkv_beta_sweep.py --threads 1 --betas '' --temperatures 0.5,2 \
        --temperature-beta 1.5 --out benchmarks/results/bench_headkv_beta_sweep/headkv_temperature_sweep.json

Writes ``benchmarks/results/bench_headkv_beta_sweep/headkv_beta_sweep.json`` (every record) and ``.md`` (the tables).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import kvtrim
from kvtrim.artifacts.store import load_artifact
from kvtrim.budgets.head_scores import HeadScoreBudget
from kvtrim.budgets.uniform import UniformBudget
from kvtrim.compression.pipeline import Pipeline
from kvtrim.eval.metrics import score_sample
from kvtrim.eval.tasks import generate_task
from kvtrim.scoring.window_attention import WindowAttentionScorer
from kvtrim.selection.topk import TopKSelector

BETAS = [1.005, 1.01, 1.1, 1.2, 1.5, 2.0, 5.0]
RATIOS = [0.5, 0.75, 0.9]
TASKS = ["passkey", "niah_single_2"]
WINDOW = 8


def _pipeline(name: str, budget) -> Pipeline:
    scorer = WindowAttentionScorer(window=WINDOW, kernel=7, pooling="max")
    return Pipeline(name, scorer, budget, TopKSelector(recent=WINDOW))


def _cut_newline(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=10, help="samples per task")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--betas", default=",".join(f"{b:g}" for b in BETAS), help="betas at temperature 1")
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS), help="compression ratios")
    parser.add_argument("--temperatures", default="", help="extra temperatures at --temperature-beta")
    parser.add_argument("--temperature-beta", type=float, default=1.2)
    parser.add_argument("--quick", action="store_true", help="two betas, one ratio")
    parser.add_argument("--artifact", type=Path, default=None, help="headkv artifact (default: search)")
    default_out = Path(__file__).parent / "results" / "bench_headkv_beta_sweep" / "headkv_beta_sweep.json"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    betas = [float(b) for b in args.betas.split(",") if b.strip()]
    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    if args.quick:
        betas, ratios = [1.01, 5.0], [0.75]
    temps = [float(t) for t in args.temperatures.split(",") if t.strip()]

    model, tok = kvtrim.load_model("smollm2-135m")
    artifact = load_artifact("headkv", model, args.artifact)
    scores = artifact.tensors["retrieval_reasoning"]
    configs: list[tuple[str, dict, Pipeline | None]] = [
        ("full", {}, None),
        ("uniform", {}, _pipeline("uniform", UniformBudget())),
    ]
    for beta in betas:
        budget = HeadScoreBudget(scores, beta=beta, temperature=1.0, window=WINDOW)
        configs.append((f"headkv b={beta:g}", {"beta": beta, "temperature": 1.0}, _pipeline("headkv", budget)))
    for temp in temps:
        budget = HeadScoreBudget(scores, beta=args.temperature_beta, temperature=temp, window=WINDOW)
        label = f"headkv b={args.temperature_beta:g} t={temp:g}"
        configs.append((label, {"beta": args.temperature_beta, "temperature": temp}, _pipeline("headkv", budget)))
    pipelines = [p for _, _, p in configs if p is not None]

    samples = [s for task in TASKS for s in generate_task(task, tok, args.length, args.samples, seed=args.seed)]
    records = []
    started = time.perf_counter()
    for n, sample in enumerate(samples):
        session = kvtrim.Session(
            model,
            tok,
            sample.context,
            methods=pipelines,
            answer_prefix=sample.answer_prefix or None,
            use_chat_template=bool(sample.meta.get("chat_template", True)),
        )
        for label, params, pipe in configs:
            for ratio in [None] if pipe is None else ratios:
                res = session.run(pipe, ratio=ratio, questions=[sample.question], max_new_tokens=sample.max_new_tokens)
                raw = res.answers[0]
                pred = _cut_newline(raw) if sample.meta.get("stop_on_newline") else raw
                budgets = res.stats.layer_budgets
                flat = [b for layer in budgets for b in layer] if budgets else []
                records.append(
                    {
                        "task": sample.task,
                        "index": sample.index,
                        "config": label,
                        **params,
                        "ratio": ratio,
                        "score": score_sample(sample, pred),
                        "prediction": pred,
                        "answers": sample.answers,
                        "context_tokens": res.stats.context_tokens,
                        "budget_min": min(flat) if flat else None,
                        "budget_max": max(flat) if flat else None,
                        "budget_std": statistics.pstdev(flat) if flat else None,
                        "budget_mean": statistics.fmean(flat) if flat else None,
                    }
                )
        elapsed = time.perf_counter() - started
        print(f"[{n + 1}/{len(samples)}] {sample.task}#{sample.index} done, {elapsed:.0f} s", flush=True)

    wall = time.perf_counter() - started
    summary = _summarise(records, configs, ratios)
    payload = {
        "description": "HeadKV beta/temperature sweep on smollm2-135m, context-only, WindowAttention(w=8,k=7,max)",
        "artifact": {"path": str(artifact.path), "model_key": artifact.meta.get("model_key")},
        "tasks": TASKS,
        "samples_per_task": args.samples,
        "length": args.length,
        "seed": args.seed,
        "ratios": ratios,
        "window": WINDOW,
        "wall_s": round(wall, 1),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "versions": {"kvtrim": kvtrim.__version__, "torch": torch.__version__},
        "summary": summary,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    md = _markdown(payload)
    args.out.with_suffix(".md").write_text(md)
    print(md)


def _summarise(records: list[dict], configs: list, ratios: list[float]) -> list[dict]:
    rows = []
    for label, params, pipe in configs:
        for ratio in [None] if pipe is None else ratios:
            sel = [r for r in records if r["config"] == label and r["ratio"] == ratio]
            row = {"config": label, **params, "ratio": ratio}
            for task in TASKS:
                vals = [r["score"] for r in sel if r["task"] == task]
                row[task] = round(100 * statistics.fmean(vals), 1) if vals else None
            row["mean"] = round(100 * statistics.fmean([r["score"] for r in sel]), 1) if sel else None
            spread = [r for r in sel if r["budget_std"] is not None]
            if spread:
                row["budget_min"] = min(r["budget_min"] for r in spread)
                row["budget_max"] = max(r["budget_max"] for r in spread)
                row["budget_std"] = round(statistics.fmean(r["budget_std"] for r in spread), 1)
                row["budget_mean"] = round(statistics.fmean(r["budget_mean"] for r in spread), 1)
            rows.append(row)
    return rows


def _markdown(payload: dict) -> str:
    lines = [
        "# HeadKV β / temperature sweep (smollm2-135m)",
        "",
        f"{payload['samples_per_task']} samples each of {', '.join(payload['tasks'])} at {payload['length']} tokens "
        f"(seed {payload['seed']}), context-only compression, scorer WindowAttention(w=8, k=7, max-pool), "
        "TopK with the last 8 tokens protected; head scores from the shipped `headkv` artifact "
        f"(`{payload['artifact']['model_key']}`, retrieval-reasoning). Scores ×100. Budget columns: per "
        "(layer, KV head) budgets including the window, min/max over all samples, std averaged over samples. "
        f"Wall time {payload['wall_s'] / 60:.0f} min ({payload['torch_threads']} thread(s)).",
        "",
        "| config | β | temp | ratio | " + " | ".join(payload["tasks"]) + " | mean | budget min | budget max | std |",
        "|---|---|---|---|" + "---|" * len(payload["tasks"]) + "---|---|---|---|",
    ]
    for row in payload["summary"]:
        cells = [
            row["config"],
            f"{row['beta']:g}" if "beta" in row else "",
            f"{row['temperature']:g}" if "temperature" in row else "",
            "" if row["ratio"] is None else f"{row['ratio']:g}",
            *[f"{row[t]:.1f}" for t in payload["tasks"]],
            f"{row['mean']:.1f}",
            str(row.get("budget_min", "")),
            str(row.get("budget_max", "")),
            str(row.get("budget_std", "")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
