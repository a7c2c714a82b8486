"""``kvtrim demo``: several methods on passkey and needle prompts with the embedded model, one table."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
from tqdm import tqdm

from .api import FULL, Session
from .eval.metrics import METRICS
from .eval.tasks import generate_task
from .methods import get_method
from .models import load_model
from .prompts import check_prompt_format

# The window-attention methods, then the ones that keep quality when the question comes after compression
# (KVzip, HeadKV, DuoAttention: docs/api.md, "Which methods survive context-only compression").
DEFAULT_METHODS = [
    "streaming_llm",
    "snapkv",
    "pyramidkv",
    "adakv",
    "critical_adakv",
    "h2o",
    "knorm",
    "tova",
    "lagkv",
    "kvcompress",
    "compilerkv",
    "random",
    "kvzip",
    "headkv",
    "duo_attention",
]


def _fmt(value: float, spec: str) -> str:
    return "-" if value != value else format(value, spec)  # NaN-safe


def run_demo(
    model: str = "smollm2-135m",
    samples: int = 2,
    length: int = 1000,
    ratios: list[float] | None = None,
    methods: list[str] | None = None,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "float32",
    prompt_format: str = "kvpress",
) -> list[dict]:
    """Run the demo and print its table; returns the table rows (``device``/``dtype``: see
    :func:`kvtrim.load_model`; ``prompt_format``: see :class:`kvtrim.Session`).

    Every prompt is prefilled once per mode (context-only and question-aware) and each (method, ratio)
    compresses its own copy of that cache, so the table compares methods on identical inputs. The default layout
    is kvpress's, under which the full cache scores best on these prompts (docs/huggingface.md, "Prompt layouts").

    Times are CPU time of this process (``GenerationStats.decode_cpu_s``, the compression's CPU time): on a machine
    shared with other jobs wall time swings with their load, CPU time does not. A row reports the median over its
    runs, leaving out the first prompt, which warms up every method (lazy imports, artifact loading, first-call
    allocations). With one torch thread, CPU time is the time the work takes on an idle core.
    """
    ratios = ratios or [0.5]
    methods = methods or DEFAULT_METHODS
    for name in methods:
        get_method(name)  # fail fast on unknown names
    check_prompt_format(prompt_format)
    started = time.perf_counter()
    lm, tokenizer = load_model(model, dtype=dtype, device=device)
    tasks = {
        "passkey": generate_task("passkey", tokenizer, length, samples, seed=seed),
        "needle": generate_task("needle", tokenizer, length, samples, seed=seed),
    }
    configs = [(FULL, None)] + [(m, r) for m in methods for r in ratios]
    results: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    jobs = [(task, s, mode) for task, ss in tasks.items() for s in ss for mode in ("context-only", "question-aware")]
    for job, (task, sample, mode) in enumerate(tqdm(jobs, desc="demo prompts", unit="prompt")):
        aware = mode == "question-aware"
        session = Session(
            lm,
            tokenizer,
            sample.context,
            question=sample.question if aware else None,
            methods=methods,
            answer_prefix=sample.answer_prefix or None,
            prompt_format=prompt_format,
        )
        for method, ratio in configs:
            res = session.run(
                method,
                ratio=ratio,
                questions=None if aware else [sample.question],
                max_new_tokens=sample.max_new_tokens,
            )
            score = METRICS[sample.metric](res.answers[0], sample.answers)
            row = results[(method, ratio)]
            row[f"{mode}:{task}"].append(score)
            row[mode].append(score)
            row["kv_bytes"].append(res.stats.kv_bytes_after)
            row["kept"].append(res.stats.kept_fraction)
            if job > 0:  # the first prompt is the warm-up
                row["compress_ms"].append(1000 * res.stats.compress_cpu_s)
                if res.stats.decode_tokens:
                    row["decode_ms"].append(res.stats.decode_cpu_ms_per_token)

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else float("nan")

    def median(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    table = []
    for (method, ratio), row in results.items():
        table.append(
            {
                "method": method,
                "ratio": ratio,
                "context_only": 100 * mean(row["context-only"]),
                "question_aware": 100 * mean(row["question-aware"]),
                "passkey_co": 100 * mean(row["context-only:passkey"]),
                "needle_co": 100 * mean(row["context-only:needle"]),
                "passkey_qa": 100 * mean(row["question-aware:passkey"]),
                "needle_qa": 100 * mean(row["question-aware:needle"]),
                "kv_mib": mean(row["kv_bytes"]) / 2**20,
                "kept_pct": 100 * mean(row["kept"]),
                "compress_ms": median(row["compress_ms"]),
                "decode_ms": median(row["decode_ms"]),
            }
        )
    header = (
        "| method | ratio | passkey ctx | needle ctx | passkey q | needle q | kept % | compress ms | decode ms/tok |"
    )
    print(
        f"\nkvtrim demo: {model} on {device} ({dtype}), {samples} prompts per task of ~{length} tokens, "
        f"{prompt_format} prompt layout, greedy decoding, {torch.get_num_threads()} torch thread(s)"
    )
    print("scores are % (passkey: exact key; needle: recall of the needle's words); ctx: context-only, the question")
    print(f"comes after compression; q: question-aware; kept %: of the {table[0]['kv_mib']:.2f} MiB of K/V entries;")
    print("times: process CPU milliseconds, median over the prompts after the first (warm-up) one\n")
    print(header)
    print("|" + "|".join(["---"] * 2 + ["---:"] * 7) + "|")
    for r in table:
        print(
            f"| {r['method']} | {'-' if r['ratio'] is None else r['ratio']} | {_fmt(r['passkey_co'], '.0f')} "
            f"| {_fmt(r['needle_co'], '.0f')} | {_fmt(r['passkey_qa'], '.0f')} | {_fmt(r['needle_qa'], '.0f')} "
            f"| {r['kept_pct']:.0f} | {_fmt(r['compress_ms'], '.0f')} | {_fmt(r['decode_ms'], '.0f')} |"
        )
    print(f"\nfinished in {time.perf_counter() - started:.0f} s")
    return table
