"""``kvtrim report DIR``: markdown tables and plots from a sweep's ``records.jsonl``.

* One table per mode (context-only, question-aware): rows are method × ratio | budget with the full cache
  first; columns are the tasks (mean score ×100), their macro average and its difference to the full cache,
  then mean kept %, KV MiB after compression, compress ms, decode ms/token and the number of samples.
  A task run at several lengths gets one column per length (``task@length``), except ``needle``, whose
  length × depth grid is averaged in the table and drawn as heatmaps.
* Plots (``plots/``, matplotlib Agg): ``score_vs_ratio_<task>.png`` (one line per method, the full cache as a
  dashed horizontal line, one panel per mode; ``score_vs_budget_<task>.png`` for budget runs) and
  ``needle_heatmap_<method>_<ratio>.png`` (depth × length; ``_qa`` suffix for question-aware runs).
* ``summary.md`` (the markdown) and ``summary.csv`` are (re)written next to the records.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvtrim.api import FULL
from kvtrim.errors import InvalidParameterError
from kvtrim.eval.runner import (
    CONTEXT_ONLY,
    QUESTION_AWARE,
    RECORDS_FILE,
    RUN_FILE,
    load_records,
    method_order,
    write_summary,
)

__all__ = ["MODE_TITLES", "RowAverage", "build_report", "column_label", "macro_averages", "write_plots"]

MODE_TITLES = {
    CONTEXT_ONLY: "context-only (question appended after compression, as kvpress / CriticalKV evaluate)",
    QUESTION_AWARE: "question-aware (context and question compressed together, as most papers evaluate)",
}
_MODE_ORDER = {CONTEXT_ONLY: 0, QUESTION_AWARE: 1}
_NEEDLE = "needle"
_MARKERS = "osD^v<>pP*X"

Row = tuple[str, float | None, int | None]  # (method, ratio, budget)
RowAverage = tuple[float, float, float, int]  # (macro average ×100, mean KV MiB, mean kept %, tasks)


def _mean(values: Iterable[Any]) -> float | None:
    xs = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(xs) if xs else None


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _ratio_label(ratio: float | None, budget: int | None) -> str:
    if ratio is not None:
        return format(ratio, "g")
    if budget is not None:
        return f"b{budget}"
    return "-"


def column_label(record: dict[str, Any], multi_length: set[str]) -> str:
    """Table column of a record: the task, or ``task@length`` when the task was run at several lengths."""
    task = record["task"]
    return f"{task}@{int(record['length'])}" if task in multi_length else task


def _columns(records: list[dict[str, Any]]) -> tuple[list[str], set[str]]:
    """Table columns in order of first appearance, and the tasks that get one column per length."""
    lengths: dict[str, set[int]] = {}
    for r in records:
        lengths.setdefault(r["task"], set()).add(int(r["length"]))
    multi = {t for t, ls in lengths.items() if len(ls) > 1 and t != _NEEDLE}
    columns: list[str] = []
    for task, ls in lengths.items():
        columns += [f"{task}@{x}" for x in sorted(ls)] if task in multi else [task]
    return columns, multi


def _row_key(record: dict[str, Any]) -> Row:
    return (record["method"], record.get("ratio"), record.get("budget"))


def _sorted_rows(rows: Iterable[Row]) -> list[Row]:
    rank = {m: i for i, m in enumerate(method_order(r[0] for r in rows))}
    return sorted(
        set(rows),
        key=lambda r: (rank[r[0]], r[1] is None and r[2] is not None, r[1] if r[1] is not None else -1, r[2] or -1),
    )


def _table(records: list[dict[str, Any]], columns: list[str], multi: set[str]) -> list[str]:
    cells: dict[Row, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_row: dict[Row, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        key = _row_key(r)
        cells[key][column_label(r, multi)].append(float(r["score"]))
        by_row[key].append(r)
    rows = _sorted_rows(by_row)
    full_row = cells.get((FULL, None, None), {})
    full_scores = {c: _mean(full_row.get(c, [])) for c in columns}
    header = ["method", "ratio / budget", *columns, "average", "Δ avg vs full", "kept %", "KV MiB", "compress ms"]
    header += ["decode ms/tok", "n"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for row in rows:
        method, ratio, budget = row
        scores = [_mean(cells[row][c]) for c in columns]
        present = [100 * s for s in scores if s is not None]
        avg = statistics.fmean(present) if present else None
        incomplete = len(present) < len(columns)
        avg_text = _fmt(avg) + ("*" if incomplete and avg is not None else "")
        # Δ compares with the full cache on the same task columns (those both rows have).
        pairs = [(100 * s, 100 * f) for s, f in zip(scores, full_scores.values(), strict=True) if None not in (s, f)]
        delta = None
        if pairs and method != FULL:
            delta = statistics.fmean(p[0] for p in pairs) - statistics.fmean(p[1] for p in pairs)
        rs = by_row[row]
        kept = _mean(r.get("kept_fraction") for r in rs)
        mib = _mean(r.get("kv_bytes_after") for r in rs)
        comp = _mean(r.get("compress_s") for r in rs)
        dec = _mean(r.get("decode_ms_per_token") for r in rs)
        counts = sorted({len(cells[row][c]) for c in columns if cells[row][c]})
        n_text = "-" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        line = [
            method,
            _ratio_label(ratio, budget),
            *[_fmt(None if s is None else 100 * s) for s in scores],
            avg_text,
            "" if delta is None else f"{delta:+.1f}",
            _fmt(None if kept is None else 100 * kept),
            _fmt(None if mib is None else mib / 2**20, ".2f"),
            _fmt(None if comp is None else 1000 * comp),
            _fmt(dec),
            n_text,
        ]
        lines.append("| " + " | ".join(line) + " |")
    return lines


# ---------------------------------------------------------------------------------------------------- plots
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _score_plot(
    plt: Any, records: list[dict[str, Any]], column: str, multi: set[str], modes: list[str], x_kind: str, path: Path
) -> bool:
    """One panel per mode: score vs. ratio (or budget) per method, full cache dashed. False if nothing to draw."""
    field = "ratio" if x_kind == "ratio" else "budget"
    mine = [r for r in records if column_label(r, multi) == column]
    if not any(r.get(field) is not None for r in mine):
        return False
    fig, axes = plt.subplots(1, len(modes), figsize=(7.2 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        rs = [r for r in mine if r["mode"] == mode]
        full = _mean(r["score"] for r in rs if r["method"] == FULL)
        series: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rs:
            if r["method"] != FULL and r.get(field) is not None:
                series[r["method"]][float(r[field])].append(float(r["score"]))
        names = method_order(series)
        ticks = sorted({x for method in names for x in series[method]})
        for i, method in enumerate(names):
            xs = sorted(series[method])
            ys = [100 * statistics.fmean(series[method][x]) for x in xs]
            # Dodge overlapping lines slightly so ties stay visible (x stays exact in the tables).
            shift = (i - (len(names) - 1) / 2) * (0.004 if x_kind == "ratio" else 0.01)
            xd = [x + shift for x in xs] if x_kind == "ratio" else [x * 2**shift for x in xs]
            ax.plot(xd, ys, marker=_MARKERS[i % len(_MARKERS)], linewidth=1.3, markersize=5, label=method)
        if full is not None:
            ax.axhline(100 * full, color="black", linestyle="--", linewidth=1.2, label="full cache")
        if x_kind == "budget":
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (entries kept per layer and KV head)")
        else:
            ax.set_xlabel("compression ratio (fraction of KV entries removed)")
        if ticks:
            _frame_x(ax, ticks, x_kind)
        ax.set_ylabel("score (×100)")
        ax.set_ylim(-3, 103)
        ax.set_title(f"{column}: {mode}")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
        else:
            ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _frame_x(ax: Any, ticks: list[float], x_kind: str) -> None:
    """An x range that shows the measured points with room around them (a single ratio would otherwise be
    autoscaled to the width of the dodge, ±0.002), ticks at the measured values."""
    lo, hi = ticks[0], ticks[-1]
    if x_kind == "ratio":
        pad = max(0.1, 0.1 * (hi - lo))
        ax.set_xlim(max(-0.02, lo - pad), min(1.02, hi + pad))
    else:
        ax.set_xlim(lo / 1.5, hi * 1.5)
    ax.set_xticks(ticks, [format(t, "g") for t in ticks])
    ax.minorticks_off()


def _needle_heatmaps(plt: Any, records: list[dict[str, Any]], plots: Path) -> list[Path]:
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("kamradt", ["#F0496E", "#EBB839", "#0CD79F"])
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["task"] == _NEEDLE:
            groups[(r["mode"], *_row_key(r))].append(r)
    written = []
    for (mode, method, ratio, budget), rs in groups.items():
        cells: dict[tuple[int, float], list[float]] = defaultdict(list)
        for r in rs:
            meta = r.get("meta") or {}
            depth = float(meta.get("depth_percent", 0.0))
            length = int(meta.get("context_length", r["length"]))
            cells[(length, depth)].append(100 * float(r["score"]))
        lengths = sorted({k[0] for k in cells})
        depths = sorted({k[1] for k in cells})
        grid = [[_mean(cells.get((length, d), [])) for length in lengths] for d in depths]
        data = [[math.nan if v is None else v for v in row] for row in grid]
        fig, ax = plt.subplots(figsize=(max(4.0, 0.6 * len(lengths) + 2.5), max(3.0, 0.35 * len(depths) + 1.5)))
        image = ax.imshow(data, cmap=cmap, vmin=0, vmax=100, aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], rotation=45 if len(lengths) > 8 else 0)
        ax.set_yticks(range(len(depths)), [format(d, "g") for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth (%)")
        overall = _mean(v for row in grid for v in row)
        title = f"needle: {method}" + ("" if method == FULL else f" {_ratio_label(ratio, budget)}")
        ax.set_title(f"{title} ({mode}), mean {_fmt(overall)}")
        if len(lengths) * len(depths) <= 200:
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    if v is not None:
                        ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7)
        fig.colorbar(image, ax=ax, label="recall ×100")
        fig.tight_layout()
        name = "needle_heatmap_full" if method == FULL else f"needle_heatmap_{method}_{_ratio_label(ratio, budget)}"
        path = plots / f"{_slug(name)}{'_qa' if mode == QUESTION_AWARE else ''}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_plots(out_dir: str | Path, records: list[dict[str, Any]] | None = None) -> list[Path]:
    """Write the score-vs-ratio / score-vs-budget plots and needle heatmaps into ``out_dir/plots``."""
    out = Path(out_dir)
    records = load_records(out / RECORDS_FILE) if records is None else records
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    columns, multi = _columns(records)
    modes = sorted({r["mode"] for r in records}, key=lambda m: _MODE_ORDER.get(m, 9))
    written = []
    for column in columns:
        for kind in ("ratio", "budget"):
            path = plots / f"score_vs_{kind}_{_slug(column)}.png"
            if _score_plot(plt, records, column, multi, modes, kind, path):
                written.append(path)
    written += _needle_heatmaps(plt, records, plots)
    return written


# ---------------------------------------------------------------------------------------------------- report
def _header(out: Path, records: list[dict[str, Any]]) -> list[str]:
    run_path = out / RUN_FILE
    runs = json.loads(run_path.read_text(encoding="utf-8")).get("runs", []) if run_path.is_file() else []
    models = sorted({str(r.get("model")) for r in records})
    lines = [f"# kvtrim evaluation: {', '.join(models)}", ""]
    tasks: dict[str, set[int]] = defaultdict(set)
    metrics: dict[str, str] = {}
    per_task: dict[str, set[int]] = defaultdict(set)
    for r in records:
        tasks[r["task"]].add(int(r["length"]))
        metrics[r["task"]] = r.get("metric", "?")
        per_task[r["task"]].add(int(r["index"]))
    task_text = "; ".join(
        f"{t} ({metrics[t]}, {len(per_task[t])} samples, length {', '.join(map(str, sorted(ls)))})"
        for t, ls in tasks.items()
    )
    hay = sorted({str(r.get("haystack")) for r in records if r.get("haystack")})
    first = records[0]
    versions = first.get("versions") or {}
    lines += [
        f"- records: {len(records)} in `{RECORDS_FILE}`",
        f"- tasks: {task_text}",
        f"- haystacks: {', '.join(hay) or '-'} (the Paul Graham essays are not used; see `haystack_info` in records)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "- prompt layout: " + ", ".join(sorted({str(r.get("prompt_format", "kvtrim")) for r in records})),
        # as recorded: every resolved setting since KVQuant.spec, the name as given in older records
        "- entries (`kv_quant`): "
        + ", ".join(sorted({str(r.get("kv_quant") or "none (the model's dtype)") for r in records})),
    ]
    if runs:
        timed = [r for r in runs if r.get("wall_s") is not None]
        wall = sum(float(r["wall_s"]) for r in timed)
        written = sum(int(r.get("records_written") or 0) for r in runs)
        # --threads when given, else the torch thread count the run recorded in its environment
        threads = sorted({str(r.get("threads") or r.get("environment", {}).get("torch_threads")) for r in runs})
        untimed = len(runs) - len(timed)
        interrupted = sum(1 for r in runs if r.get("status") == "interrupted")
        notes = []
        if interrupted:
            notes.append(f"{interrupted} interrupted")
        if untimed:
            notes.append(f"{untimed} killed before recording a wall time, not counted")
        lines.append(
            f"- sweep wall time (from `{RUN_FILE}`): {wall / 60:.1f} min over {len(runs)} invocation(s)"
            + (f" ({'; '.join(notes)})" if notes else "")
            + f", {written} records computed (torch threads: {', '.join(threads)}; "
            f"cpu count: {runs[-1].get('environment', {}).get('cpu_count')})"
        )
    stamps = sorted(str(r["timestamp"]) for r in records if r.get("timestamp"))
    if stamps:
        lines.append(f"- record timestamps: {stamps[0]} → {stamps[-1]} (UTC)")
    lines += [
        "- scores: mean ×100 of each task's metric over samples; `average` is the macro average over the task "
        "columns (`*`: some task missing for that row); `kept %` = KV entries after / before compression; "
        "`KV MiB` = key+value bytes kept; timings are wall-clock on a shared CPU and only roughly comparable.",
        "",
    ]
    return lines


def macro_averages(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, float | None], RowAverage]:
    """Per ``(mode, method, ratio)``: the macro average over tasks of the mean score (×100), the mean KV MiB held
    after compression, the mean kept % and the number of tasks present (a row short of a task shows it here)."""
    scores: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    mib: dict[tuple, list[float]] = defaultdict(list)
    kept: dict[tuple, list[float]] = defaultdict(list)
    for rec in records:
        key = (rec["mode"], rec["method"], rec["ratio"])
        scores[key][rec["task"]].append(rec["score"])
        mib[key].append(rec["kv_bytes_after"] / 2**20)
        kept[key].append(100 * rec["kept_fraction"])
    return {
        key: (
            100 * statistics.fmean(statistics.fmean(v) for v in tasks.values()),
            statistics.fmean(mib[key]),
            statistics.fmean(kept[key]),
            len(tasks),
        )
        for key, tasks in scores.items()
    }


def build_report(out_dir: str | Path, plots: bool = True) -> str:
    """Markdown report of the sweep in ``out_dir``; also writes ``summary.md``, ``summary.csv`` and the plots."""
    out = Path(out_dir)
    if not out.is_dir():
        raise InvalidParameterError(f"{out}: not a directory (pass the --out directory of `kvtrim eval`)")
    records = load_records(out / RECORDS_FILE)
    if not records:
        raise InvalidParameterError(f"{out}: no records in {out / RECORDS_FILE}")
    write_summary(out)
    columns, multi = _columns(records)
    lines = _header(out, records)
    modes = sorted({r["mode"] for r in records}, key=lambda m: _MODE_ORDER.get(m, 9))
    for mode in modes:
        lines += [f"## {MODE_TITLES.get(mode, mode)}", ""]
        lines += _table([r for r in records if r["mode"] == mode], columns, multi)
        lines.append("")
    if plots:
        written = write_plots(out, records)
        if written:
            lines += ["## Plots", ""]
            lines += [f"![{p.stem}](plots/{p.name})" for p in written]
            lines.append("")
    text = "\n".join(lines)
    (out / "summary.md").write_text(text, encoding="utf-8")
    return text
