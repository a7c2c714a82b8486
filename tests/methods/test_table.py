"""The README's method table is generated from the registry."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtrim.cli import app
from kvtrim.errors import InvalidParameterError
from kvtrim.methods import method_names
from kvtrim.methods.table import END, START, cite, markdown_table, read_block, replace_block

README = Path(__file__).resolve().parents[2] / "README.md"
runner = CliRunner()


def test_readme_block_is_the_generated_table():
    assert read_block(README.read_text(encoding="utf-8")) == markdown_table(), (
        "README.md's method table is stale: run `kvtrim methods --markdown --write README.md`"
    )


def test_one_row_per_method():
    rows = markdown_table().splitlines()[2:]
    assert len(rows) == len(method_names())
    assert sorted(row.split("`")[1] for row in rows) == method_names()


def test_cite():
    assert cite("Li et al., SnapKV: X, NeurIPS 2024 (arXiv 2404.14469)") == (
        "Li et al. [2404.14469](https://arxiv.org/abs/2404.14469)"
    )
    assert cite("Rehg, KV-Compress: Y (arXiv 2410.00161)").startswith("Rehg [2410.00161]")
    assert cite("A et al., P (arXiv 2401.00001); score from B et al., Q (arXiv 2401.00002)") == (
        "A et al. [2401.00001](https://arxiv.org/abs/2401.00001); B et al. [2401.00002](https://arxiv.org/abs/2401.00002)"
    )
    assert cite("A baseline without a paper") == "—"


def test_replace_block_needs_the_markers_once_and_in_order():
    text = f"head\n{START}\nold\n{END}\ntail\n"
    new = replace_block(text, "T\n")
    assert new == f"head\n{START}\nT\n{END}\ntail\n" and replace_block(new, "T\n") == new
    for bad in ("no markers", f"{END}\n{START}\n", f"{START}\n{START}\n{END}\n"):
        with pytest.raises(InvalidParameterError, match="methods-table:start"):
            replace_block(bad, "T\n")


def test_cli_prints_and_writes_the_table(tmp_path):
    result = runner.invoke(app, ["methods", "--markdown"])
    assert result.exit_code == 0 and result.output == markdown_table()
    target = tmp_path / "doc.md"
    target.write_text(f"# doc\n{START}\n| stale |\n{END}\nafter\n", encoding="utf-8")
    result = runner.invoke(app, ["methods", "--markdown", "--write", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_text(encoding="utf-8") == f"# doc\n{START}\n{markdown_table()}{END}\nafter\n"


def test_cli_refuses_a_file_without_markers(tmp_path):
    target = tmp_path / "doc.md"
    target.write_text("no table here\n", encoding="utf-8")
    result = runner.invoke(app, ["methods", "--markdown", "--write", str(target)])
    assert result.exit_code == 2 and "methods-table:start" in result.output
    assert target.read_text(encoding="utf-8") == "no table here\n"  # unchanged
    result = runner.invoke(app, ["methods", "--write", str(target)])
    assert result.exit_code == 2 and "--write needs --markdown" in result.output


def test_listing_shows_family_and_capabilities():
    result = runner.invoke(app, ["methods"])
    assert result.exit_code == 0
    assert "family:   attention eviction; attention, question-aware, vLLM" in result.output
