"""benchmarks/kvquant_table.py: one column per entry format, and draws of prompts pooled, on hand-made records."""

from __future__ import annotations

import json
import pathlib

import pytest

from script_loader import load_script


@pytest.fixture(scope="module")
def table():
    return load_script("benchmarks/kvquant_table.py")


def _record(method, task, score, ratio=0.875):
    return {"mode": "context-only", "method": method, "ratio": ratio, "task": task, "score": score,
            "kv_bytes_after": 2**20, "kept_fraction": 1 - ratio}  # fmt: skip


def _draw(root: pathlib.Path, formats: dict[str, list[dict]]) -> pathlib.Path:
    for fmt, records in formats.items():
        (root / fmt).mkdir(parents=True)
        text = "".join(json.dumps(r) + "\n" for r in records)
        (root / fmt / "records.jsonl").write_text(text, encoding="utf-8")
    return root


def _row(text: str, method: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(f"| context-only | {method} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_pooled_draws_average_every_prompt_of_each_task(table, tmp_path):
    # task a: 1, 0 in the first draw and 1, 1 in the second; task b: 0 then 1 (unquantized)
    def scores(*values):
        return [_record("kvzip", task, v) for task, v in zip("aab", values, strict=True)]

    first = _draw(tmp_path / "d1", {"none": scores(1, 0, 0), "int8": scores(0, 0, 0)})
    second = _draw(tmp_path / "d2", {"none": scores(1, 1, 1), "int8": scores(1, 1, 1)})
    alone = _row(table.build(first, ["none", "int8"]), "kvzip")
    assert alone[3:5] == ["25.0", "0.0 (-25.0)"] and len(alone) == 7  # (50 + 0) / 2 and 0: no prompts column
    pooled = table.build(first, ["none", "int8"], [second])
    assert "d1 pooled with d2" in pooled
    # none: a = 3/4, b = 1/2 → 62.5; int8: a = 2/4, b = 1/2 → 50.0; six prompts each
    assert _row(pooled, "kvzip")[3:5] == ["62.5", "50.0 (-12.5)"] and _row(pooled, "kvzip")[-1] == "6 / 6"


def test_change_is_paired_over_the_prompts_both_formats_ran(table, tmp_path):
    def prompt(seed, index, score):
        return {**_record("kvzip", "a", score), "seed": seed, "index": index}

    # none ran two draws (seed 1: 0, 0; seed 2: 1, 1), int8 only the first (1, 0)
    first = _draw(
        tmp_path / "d1", {"none": [prompt(1, 0, 0), prompt(1, 1, 0)], "int8": [prompt(1, 0, 1), prompt(1, 1, 0)]}
    )
    second = _draw(tmp_path / "d2", {"none": [prompt(2, 0, 1), prompt(2, 1, 1)]})
    row = _row(table.build(first, ["none", "int8"], [second]), "kvzip")
    # none over its four prompts: 50.0; int8 50.0, but +50.0 against none's 0.0 on the two prompts both ran
    assert row[3:5] == ["50.0", "50.0 (+50.0)"] and row[-1] == "4 / 2"
    assert table.paired_change([prompt(3, 0, 1)], [prompt(1, 0, 1)]) is None  # no prompt in common


def test_interval_is_seeded_holds_the_change_and_shrinks_with_more_prompts(table, tmp_path):
    def prompts(seed, scores, task="a"):
        return [{**_record("kvzip", task, s), "seed": seed, "index": i} for i, s in enumerate(scores)]

    base = prompts(1, [1, 1, 0, 0, 1, 0]) + prompts(1, [1, 0], task="b")
    mine = prompts(1, [1, 0, 0, 0, 1, 1]) + prompts(1, [1, 0], task="b")
    change = table.paired_change(mine, base)  # task a: 0 on average (one lost, one gained), task b: 0
    low, high = table.paired_interval(mine, base, 2000)
    assert change == 0.0 and low < 0.0 < high and (low, high) == table.paired_interval(mine, base, 2000)
    assert table.paired_interval(base, base, 500) == (0.0, 0.0)  # no prompt changed: no spread
    wide = table.paired_interval(prompts(1, [0, 1]), prompts(1, [1, 1]), 4000)
    narrow = table.paired_interval(prompts(1, [0, 1] * 20), prompts(1, [1, 1] * 20), 4000)
    assert wide[1] - wide[0] > narrow[1] - narrow[0] > 0
    first = _draw(tmp_path / "d1", {"none": base, "int8": mine})
    cell = _row(table.build(first, ["none", "int8"], ci=1000), "kvzip")[4]
    assert cell.startswith("50.0 (+0.0; -") and "…+" in cell, cell  # a: 3/6, b: 1/2; interval around 0


def test_differing_share_counts_gains_and_losses_alike(table, tmp_path):
    def prompts(scores):
        return [{**_record("kvzip", "a", s), "seed": 1, "index": i} for i, s in enumerate(scores)]

    base, mine = prompts([1, 1, 0, 0]), prompts([1, 0, 1, 0])  # one lost, one gained: no change, half differ
    assert table.paired_change(mine, base) == 0.0 and table.differing_share(mine, base) == 50.0
    assert table.differing_share(base, base) == 0.0
    assert table.differing_share(prompts([1]), [{**_record("kvzip", "a", 1), "seed": 2, "index": 0}]) is None
    first = _draw(tmp_path / "d1", {"none": base, "int8": mine})
    assert _row(table.build(first, ["none", "int8"], differ=True), "kvzip")[4] == "50.0 (+0.0; ≠ 50 %)"
    assert "≠" not in table.build(first, ["none", "int8"])  # only when asked
