"""benchmarks/ratio_table.py: method × ratio cells from several sweep folders, on hand-made records."""

from __future__ import annotations

import json
import pathlib

import pytest

from script_loader import load_script

TASKS = ("a", "b")


@pytest.fixture(scope="module")
def table():
    return load_script("benchmarks/ratio_table.py")


def _record(method, ratio, task, score, kept=None, mode="context-only"):
    kept = kept if kept is not None else (1.0 if ratio is None else 1 - ratio)
    return {"mode": mode, "method": method, "ratio": ratio, "task": task, "score": score,
            "kv_bytes_after": 2**20, "kept_fraction": kept}  # fmt: skip


def _folder(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    path.mkdir()
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _rows(text: str) -> dict[str, list[str]]:
    out = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| method"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0]] = cells[1:]
    return out


def test_cells_average_tasks_and_order_methods(table, tmp_path):
    half = _folder(tmp_path / "r05", [
        _record("full", None, "a", 1.0), _record("full", None, "b", 0.5),
        _record("good", 0.5, "a", 1.0), _record("good", 0.5, "b", 0.0),
        _record("bad", 0.5, "a", 0.0), _record("bad", 0.5, "b", 0.2),
    ])  # fmt: skip
    most = _folder(tmp_path / "r09", [
        _record("good", 0.9, "a", 0.5), _record("good", 0.9, "b", 0.5),
        _record("bad", 0.9, "a", 0.0),  # task b missing
        _record("greedy", 0.9, "a", 1.0, kept=0.33), _record("greedy", 0.9, "b", 1.0, kept=0.33),
    ])  # fmt: skip
    rows = _rows(table.build([half, most]))
    assert rows["full"] == ["75.0", "75.0", "75.0"]
    assert rows["good"] == ["50.0", "50.0", "50.0"]
    assert rows["bad"] == ["10.0", "0.0*", "5.0"]
    assert rows["greedy"] == ["", "100.0 (33 %)", "100.0 (partial)"]  # keeps 33 % at ratio 0.9: shown
    assert list(rows) == ["full", "greedy", "good", "bad"]  # full first, then by mean


def test_only_keeps_the_named_methods_and_the_full_cache(table, tmp_path):
    folder = _folder(tmp_path / "r05", [
        _record("full", None, "a", 1.0), _record("x", 0.5, "a", 0.4), _record("y", 0.5, "a", 0.2),
    ])  # fmt: skip
    assert list(_rows(table.build([folder], only=("y",)))) == ["full", "y"]


def test_modes_get_their_own_tables(table, tmp_path):
    folder = _folder(tmp_path / "both", [
        _record("full", None, "a", 1.0), _record("x", 0.5, "a", 0.4),
        _record("full", None, "a", 0.0, mode="question-aware"), _record("x", 0.5, "a", 0.8, mode="question-aware"),
    ])  # fmt: skip
    text = table.build([folder])
    context, question = text.split("## question-aware")
    assert _rows(context)["x"] == ["40.0", "40.0"] and _rows(question)["x"] == ["80.0", "80.0"]


def test_no_records_is_an_error(table, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no records"):
        table.build([tmp_path / "empty"])
