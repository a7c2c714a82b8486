"""One table per mode of method × ratio from several ``kvtrim eval`` sweeps (one folder per ratio and mode).

Reads ``records.jsonl`` / ``records.jsonl.gz`` of every folder given and writes one markdown file: for each mode
(context-only, question-aware) a row per method and a column per ratio holding the macro-average score over the
tasks (×100), the full cache first, then the methods by their mean over the ratios they have. A cell short of a
task is starred; a cell whose kept % differs from ``100·(1 − ratio)`` by more than two points shows it in
brackets (a method that keeps more or fewer entries than its ratio asks is not compared at equal memory).

    PYTHONPATH=src python benchmarks/ratio_table.py benchmarks/results/kvpress_all_{05,075,0875,09}_context_only \\
        benchmarks/results/kvpress_all_{05,075,0875,09}_question_aware --out benchmarks/results/kvpress_all_ratios.md
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from kvtrim.eval.report import MODE_TITLES, macro_averages
from kvtrim.eval.runner import load_records

KEPT_TOLERANCE = 2.0  # percentage points between the kept % and 100·(1 − ratio) before a cell shows its kept %


def build(folders: list[Path], pinned: tuple[str, ...] = ("full",), only: tuple[str, ...] = ()) -> str:
    """The markdown of the tables; ``pinned`` methods come first, in that order; ``only``: these methods (and the
    full cache) and no others."""
    records = [rec for folder in folders for rec in load_records(folder)]
    if only:
        records = [rec for rec in records if rec["method"] in only or rec["ratio"] is None]
    if not records:
        raise SystemExit(f"no records in {', '.join(map(str, folders))}")
    rows = macro_averages(records)
    all_tasks = max(n for *_, n in rows.values())
    lines = [
        f"# Average score (×100) over {all_tasks} tasks, method × ratio",
        "",
        f"From {len(folders)} sweep folders: " + ", ".join(f"`{f.name}`" for f in folders) + ".",
        "`*`: a task is missing from that cell. In brackets: the kept % where it differs from `100·(1 − ratio)` by",
        f"more than {KEPT_TOLERANCE:g} points.",
    ]
    for mode in sorted({key[0] for key in rows}):
        mode_rows = {key[1:]: value for key, value in rows.items() if key[0] == mode}
        ratios = sorted({ratio for _, ratio in mode_rows if ratio is not None})
        methods = sorted({method for method, _ in mode_rows})

        cells = {m: [mode_rows[(m, r)][0] for r in ratios if (m, r) in mode_rows] for m in methods}
        order = [m for m in pinned if m in methods]
        order += sorted((m for m in methods if m not in order), key=lambda m: -statistics.fmean(cells[m] or [0.0]))
        lines += ["", f"## {MODE_TITLES.get(mode, mode)}", ""]
        lines.append("| method | " + " | ".join(f"{r:g}" for r in ratios) + " | mean |")
        lines.append("|---|" + "---:|" * (len(ratios) + 1))
        for method in order:
            if (method, None) in mode_rows:  # the full cache: one value, every column
                avg, _, _, n = mode_rows[(method, None)]
                text = f"{avg:.1f}" + ("*" if n < all_tasks else "")
                lines.append(f"| {method} | " + " | ".join([text] * len(ratios)) + f" | {text} |")
                continue
            row = []
            for ratio in ratios:
                got = mode_rows.get((method, ratio))
                if got is None:
                    row.append("")
                    continue
                avg, _, kept, n = got
                text = f"{avg:.1f}" + ("*" if n < all_tasks else "")
                if abs(kept - 100 * (1 - ratio)) > KEPT_TOLERANCE:
                    text += f" ({kept:.0f} %)"
                row.append(text)
            mean = cells[method]
            tail = f"{statistics.fmean(mean):.1f}" + ("" if len(mean) == len(ratios) else " (partial)")
            lines.append(f"| {method} | " + " | ".join(row) + f" | {tail} |")
    return "\n".join(lines) + "\n"


def _names(text: str) -> tuple[str, ...]:
    return tuple(m for m in text.split(",") if m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+", help="sweep folders (the --out of `kvtrim eval`)")
    parser.add_argument("--out", type=Path, required=True, help="markdown file to write")
    parser.add_argument("--pinned", default="full,snapkv,kvzip,headkv", help="methods listed first, in order")
    parser.add_argument("--methods", default="", help="comma-separated: only these rows (and the full cache)")
    args = parser.parse_args()
    text = build(args.folders, _names(args.pinned), _names(args.methods))
    args.out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
