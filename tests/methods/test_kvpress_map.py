"""Every kvpress export has a row in docs/kvpress.md, the rows name real methods, and the page is the generated one."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrim.errors import InvalidParameterError
from kvtrim.methods import kvpress_map
from kvtrim.methods.kvpress_map import (
    BASES,
    END,
    MAPPINGS,
    START,
    kvpress_exports,
    markdown_table,
    read_block,
    unmapped,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "kvpress.md"


def test_export_list_is_the_release_s():
    exports = kvpress_exports()
    assert exports["version"] == "0.5.5"
    assert len(exports["presses"]) == 43
    assert exports["bases"] == ["BasePress", "ComposedPress", "ScorerPress"]
    assert exports["other"] == ["KVPressTextGenerationPipeline"]


def test_every_export_has_exactly_one_row():
    exports = kvpress_exports()
    presses = [row.press for row in MAPPINGS]
    assert len(presses) == len(set(presses))
    assert unmapped() == [], f"kvpress exports without a row in kvpress_map.MAPPINGS: {unmapped()}"
    assert sorted(presses) == exports["presses"], "MAPPINGS holds a press kvpress does not export"
    assert sorted(row.press for row in BASES) == sorted(exports["bases"] + exports["other"])


def test_a_missing_row_is_caught():
    assert unmapped(MAPPINGS[1:]) == [MAPPINGS[0].press]
    assert unmapped(()) == kvpress_exports()["presses"]


def test_every_row_either_maps_or_says_why_not():
    for row in MAPPINGS:
        assert row.note.strip(), row.press
        if row.method is None:
            assert row.params == {}, row.press


def test_table_rejects_an_unknown_method_or_parameter(monkeypatch):
    bad = kvpress_map.PressMapping("SnapKVPress", "snapkv_nope", "x")
    monkeypatch.setattr(kvpress_map, "MAPPINGS", (bad,))
    with pytest.raises(InvalidParameterError, match="snapkv_nope"):
        markdown_table()
    bad = kvpress_map.PressMapping("SnapKVPress", "snapkv", "x", {"window_size": 64})
    monkeypatch.setattr(kvpress_map, "MAPPINGS", (bad,))
    with pytest.raises(InvalidParameterError, match="window_size"):
        markdown_table()


def test_one_table_row_per_export():
    rows = markdown_table().splitlines()[2:]
    exports = kvpress_exports()
    assert len(rows) == len(exports["presses"]) + len(exports["bases"]) + len(exports["other"])


def test_doc_is_the_generated_table():
    text = DOC.read_text(encoding="utf-8")
    assert START in text and END in text
    assert read_block(text) == markdown_table(), (
        "docs/kvpress.md is stale: run `python -m kvtrim.methods.kvpress_map --write docs/kvpress.md`"
    )


def test_the_export_tool_reads_a_wheel_s_all(tmp_path):
    import zipfile

    from script_loader import load_script

    module = load_script("tools/kvpress_exports.py")
    init = (
        "from kvpress.pipeline import KVPressTextGenerationPipeline\n"
        "from kvpress.presses.base_press import BasePress\n"
        "from kvpress.presses.scorer_press import ScorerPress\n"
        "from kvpress.presses.composed_press import ComposedPress\n"
        "from kvpress.presses.b_press import BPress\n"
        "from kvpress.presses.a_press import APress\n"
        "__all__ = ['BPress', 'BasePress', 'ScorerPress', 'ComposedPress', 'APress', 'KVPressTextGenerationPipeline']\n"
    )
    wheel = tmp_path / "kvpress-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("kvpress/__init__.py", init)
    assert module.exports(str(wheel)) == {
        "package": "kvpress", "version": "9.9.9", "presses": ["APress", "BPress"],
        "bases": ["BasePress", "ComposedPress", "ScorerPress"], "other": ["KVPressTextGenerationPipeline"],
    }  # fmt: skip
