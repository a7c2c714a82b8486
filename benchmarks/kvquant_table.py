"""Side-by-side table of one sweep per entry format (``kvtrim eval --kv-quant FORMAT``, one folder each).

Reads ``records.jsonl`` (and ``records.jsonl.gz``) of every ``ROOT/FORMAT`` folder given, and writes
``ROOT/comparison.md``: per (mode, method, ratio) the macro-average score over the tasks (×100) in each format,
the change against the unquantized folder (``none``) in brackets, and the KV MiB held in each format.

    PYTHONPATH=src python benchmarks/kvquant_table.py benchmarks/results/kvquant_harness_1k \
        --formats none,int8,int4,int4_group64,fp8

``--pool ROOT2,ROOT3`` adds the records of the same formats from other draws of prompts (``kvtrim eval --seed``),
so each row averages every prompt any draw ran for it (a ``prompts`` column counts them), written to ``--out``.

The change in brackets is paired: both sides are averaged over the prompts (seed, task, index, length) that the
format and ``none`` both ran for that row, so a baseline with more draws than a format does not enter its change.
``--ci N`` adds its 95 % interval from N bootstrap resamples of those prompts, drawn within each task (the average
is over tasks): a row whose interval holds both a target's bound and 0 has too few prompts to tell the two apart.
``--differ`` adds the share of those prompts whose score differs from the unquantized one, gains and losses alike
(a change near 0 can hide as many gains as losses).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np

from kvtrim.eval.report import macro_averages
from kvtrim.eval.runner import load_records


def _prompt(record: dict) -> tuple:
    return record.get("seed"), record["task"], record.get("index"), record.get("length")


def paired_change(records: list[dict], baseline: list[dict]) -> float | None:
    """Macro-average change (×100) of ``records`` against ``baseline`` (one row each) over the prompts both ran;
    None when they share none."""
    common = {_prompt(r) for r in records} & {_prompt(r) for r in baseline}
    if not common:
        return None
    (mine,) = macro_averages(r for r in records if _prompt(r) in common).values()
    (ref,) = macro_averages(r for r in baseline if _prompt(r) in common).values()
    return mine[0] - ref[0]


def _paired_diffs(records: list[dict], baseline: list[dict]) -> dict[str, list[float]]:
    """Per task, the score change of each prompt both ran (``records`` minus ``baseline``)."""
    base = {_prompt(r): r["score"] for r in baseline}
    diffs: dict[str, list[float]] = {}
    for r in records:
        if _prompt(r) in base:
            diffs.setdefault(r["task"], []).append(r["score"] - base[_prompt(r)])
    return diffs


def paired_interval(
    records: list[dict], baseline: list[dict], resamples: int, seed: int = 0
) -> tuple[float, float] | None:
    """95 % bootstrap interval (×100) of :func:`paired_change`: the shared prompts resampled with replacement
    within each task, ``resamples`` times (seeded); None when they share no prompt."""
    diffs = _paired_diffs(records, baseline)
    if not diffs:
        return None
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    for task in sorted(diffs):
        d = np.asarray(diffs[task], dtype=float)
        total += d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    low, high = np.percentile(100 * total / len(diffs), [2.5, 97.5])
    return float(low), float(high)


def differing_share(records: list[dict], baseline: list[dict]) -> float | None:
    """Percentage of the prompts both ran whose score differs from the baseline's (any change, either way); None
    when they share none. Where the change averages gains against losses, this counts both."""
    changes = [d for task in _paired_diffs(records, baseline).values() for d in task]
    return 100 * sum(d != 0 for d in changes) / len(changes) if changes else None


def build(
    root: Path, formats: list[str], pool: list[Path] | None = None, ci: int = 0, differ: bool = False
) -> str:
    roots = [root, *(pool or [])]
    records = {fmt: [r for d in roots for r in load_records(d / fmt)] for fmt in formats}
    data = {fmt: macro_averages(recs) for fmt, recs in records.items() if recs}
    by_row: dict[str, dict[tuple, list[dict]]] = {fmt: {} for fmt in records}
    for fmt, recs in records.items():
        for r in recs:
            by_row[fmt].setdefault((r["mode"], r["method"], r["ratio"]), []).append(r)
    counts = {fmt: Counter({key: len(recs) for key, recs in rows.items()}) for fmt, rows in by_row.items()}
    all_tasks = max((n for rows in data.values() for *_, n in rows.values()), default=0)
    keys = sorted(
        {k for rows in data.values() for k in rows},
        key=lambda k: (k[0], k[1] != "full", k[1], k[2] if k[2] is not None else -1),
    )
    cols = list(data)
    title = root.name if not pool else f"{root.name} pooled with {', '.join(p.name for p in pool)}"
    lines = [
        f"# {title}: average score (×100) over {all_tasks} tasks per entry format",
        "",
        "In brackets: the change against the same row with unquantized entries (`none`), both averaged over the",
        "prompts they share. `*`: a task is missing from that cell (the sweep did not reach it). `KV MiB`: mean",
        "key + value bytes held after compression."
        + (f" After `;`: the change's 95 % interval, {ci:,} bootstrap resamples of the shared prompts." if ci else "")
        + (" `≠`: the share of the shared prompts whose score differs from the unquantized one." if differ else ""),
        "",
        "| mode | method | ratio | "
        + " | ".join(cols)
        + " | "
        + " | ".join(f"KV MiB {c}" for c in cols)
        + " |"
        + (" prompts (" + " / ".join(cols) + ") |" if pool else ""),
        "|---|---|---|" + "---:|" * (2 * len(cols) + bool(pool)),
    ]
    for key in keys:
        mode, method, ratio = key
        baseline = by_row.get("none", {}).get(key)
        cells, mibs = [], []
        for fmt in cols:
            got = data[fmt].get(key)
            if got is None:
                cells.append("")
                mibs.append("")
                continue
            avg, mb, _, n = got
            star = "*" if n < all_tasks else ""
            change = None if baseline is None or fmt == "none" else paired_change(by_row[fmt][key], baseline)
            delta = ""
            if change is not None:
                interval = paired_interval(by_row[fmt][key], baseline, ci) if ci else None
                share = differing_share(by_row[fmt][key], baseline) if differ else None
                delta = (
                    f" ({change:+.1f}"
                    + (f"; {interval[0]:+.1f}…{interval[1]:+.1f}" if interval else "")
                    + (f"; ≠ {share:.0f} %" if share is not None else "")
                    + ")"
                )
            cells.append(f"{avg:.1f}{star}{delta}")
            mibs.append(f"{mb:.2f}")
        ratio_s = "-" if ratio is None else f"{ratio:g}"
        prompts = " " + " / ".join(str(counts[fmt][key]) for fmt in cols) + " |" if pool else ""
        row = f"| {mode} | {method} | {ratio_s} | " + " | ".join(cells) + " | " + " | ".join(mibs) + " |"
        lines.append(row + prompts)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="folder holding one sweep folder per format")
    parser.add_argument("--formats", default="none,int8,int4,fp8", help="comma-separated folder names")
    parser.add_argument("--pool", default="", help="comma-separated folders of other draws to pool in")
    parser.add_argument("--out", type=Path, default=None, help="output file (default: ROOT/comparison.md)")
    parser.add_argument("--ci", type=int, default=0, help="bootstrap resamples for a 95%% interval (0: none)")
    parser.add_argument(
        "--differ", action="store_true", help="add the share of shared prompts whose score differs from `none`"
    )
    args = parser.parse_args()
    pool = [Path(p) for p in args.pool.split(",") if p]
    if args.ci < 0:
        parser.error(f"--ci must be >= 0, got {args.ci}")
    text = build(args.root, [f for f in args.formats.split(",") if f], pool, args.ci, args.differ)
    (args.out or args.root / "comparison.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
