"""Compact markdown tables of the side-by-side sweep of the newer methods, as quoted in docs/methods-kvpress.md
and docs/methods-think-duo.md.

Run from the repository root: ``python benchmarks/results/methods_side_by_side_context_only/compact_tables.py``.
Reads ``records.jsonl`` of ``methods_side_by_side_context_only`` and ``methods_side_by_side_question_aware``. A prompt
(task, index) counts only when every (method, ratio) of ``MAIN`` and the full cache has a record for it, so every
cell of a column rests on the same prompts. Cells are mean score x100; ``avg`` is the macro average over tasks;
KV bytes % = bytes kept / full.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["passkey", "niah_single_2", "niah_multikey_1", "vt", "fwe"]
MAIN = [
    "streaming_llm",
    "snapkv",
    "knorm",
    "tova",
    "expected_attention",
    "keydiff",
    "chunkkv",
    "kvzip",
    "think",
    "duo_attention",
]
# Methods dropped after the first two tasks (see NOTES.md), compared on the prompts they have.
EXTRA = {"chunkkv_reuse": "chunkkv", "think_snapkv": "snapkv"}
RATIOS = [0.5, 0.75, 0.9]


def _load(mode: str) -> list[dict]:
    path = ROOT / f"methods_side_by_side_{mode}" / "records.jsonl"
    return [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]


def _complete(records: list[dict], methods: list[str]) -> set[tuple[str, int]]:
    have: dict[tuple[str, int], set] = defaultdict(set)
    for r in records:
        have[(r["task"], r["index"])].add((r["method"], r["ratio"]))
    need = {("full", None)} | {(m, x) for m in methods for x in RATIOS}
    return {p for p, got in have.items() if need <= got}


def _row(records: list[dict], prompts: set, method: str, ratio: float | None, tasks: list[str]) -> str:
    scores: dict[str, list[float]] = defaultdict(list)
    kept: list[float] = []
    for r in records:
        if (r["task"], r["index"]) in prompts and r["method"] == method and r["ratio"] == ratio:
            scores[r["task"]].append(100 * r["score"])
            kept.append(100 * r["kv_bytes_after"] / r["kv_bytes_before"])
    per = [sum(scores[t]) / len(scores[t]) if scores[t] else float("nan") for t in tasks]
    avg = sum(per) / len(per)
    return f"{avg:.0f} ({'/'.join(f'{v:.0f}' for v in per)})", f"{sum(kept) / len(kept):.0f}"


def timings(mode: str) -> str:
    """Ranges of prefill seconds and of compress seconds per method (KVzip's pass runs at its first ratio, 0.5)."""
    records = _load(mode)
    prefill = [r["prefill_s"] for r in records if r["method"] == "full" and r.get("prefill_s")]
    out = [f"{mode}: prefill {min(prefill):.0f}-{max(prefill):.0f} s"]
    by: dict[tuple[str, float], list[float]] = defaultdict(list)
    for r in records:
        if r["method"] != "full":
            by[(r["method"], r["ratio"])].append(r["compress_s"])
    for (m, x), v in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.append(f"  {m} {x}: compress {min(v):.1f}-{max(v):.1f} s (n={len(v)})")
    return "\n".join(out)


def table(mode: str, methods: list[str]) -> str:
    records = _load(mode)
    prompts = _complete(records, MAIN)
    tasks = [t for t in TASKS if any(p[0] == t for p in prompts)]
    n = {t: sum(1 for p in prompts if p[0] == t) for t in tasks}
    out = [
        f"{mode}: prompts per task " + ", ".join(f"{t} {n[t]}" for t in tasks),
        "",
        "| method | 0.5: avg (per task) | 0.75: avg (per task) | 0.9: avg (per task) | KV bytes % at 0.5/0.75/0.9 |",
        "|---|---|---|---|---|",
    ]
    full, _ = _row(records, prompts, "full", None, tasks)
    out.append(f"| full | {full} |  |  | 100 |")
    for m in [m for m in methods if m in MAIN]:
        cells = [_row(records, prompts, m, x, tasks) for x in RATIOS]
        out.append(f"| {m} | " + " | ".join(c[0] for c in cells) + " | " + "/".join(c[1] for c in cells) + " |")
    for extra, base in EXTRA.items():
        if extra not in methods:
            continue
        sub = _complete(records, [extra, base])
        sub_tasks = [t for t in TASKS if any(p[0] == t for p in sub)]
        sn = {t: sum(1 for p in sub if p[0] == t) for t in sub_tasks}
        out += [
            "",
            f"{extra} vs {base} on its prompts: " + ", ".join(f"{t} {sn[t]}" for t in sub_tasks),
            "",
            "| method | 0.5 | 0.75 | 0.9 |",
            "|---|---|---|---|",
            f"| full | {_row(records, sub, 'full', None, sub_tasks)[0]} |  |  |",
        ]
        for m in (base, extra):
            out.append(f"| {m} | " + " | ".join(_row(records, sub, m, x, sub_tasks)[0] for x in RATIOS) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    # optional argument: comma-separated rows to print (default: every method)
    rows = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] != "--timings" else [*MAIN, *EXTRA]
    for mode in ("context_only", "question_aware"):
        print(table(mode, [m for m in rows if m in MAIN or m in EXTRA]), end="\n\n")
    if "--timings" in sys.argv:
        for mode in ("context_only", "question_aware"):
            print(timings(mode))
