"""``build_report`` / ``kvtrim report``: markdown tables, plots and summary files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import byte_tokenizer, tiny_model
from kvtrim.cli import app
from kvtrim.errors import InvalidParameterError
from kvtrim.eval.report import build_report
from kvtrim.eval.runner import RECORDS_FILE, SUMMARY_FILE, load_records, run_sweep

cli = CliRunner()
PNG = b"\x89PNG"


def _rec(task, index, method, ratio, score, mode="context-only", length=1024, **extra):
    base = {
        "task": task,
        "index": index,
        "method": method,
        "ratio": ratio,
        "budget": None,
        "mode": mode,
        "length": length,
        "score": score,
        "metric": "string_match_all",
        "model": "tiny",
        "haystack": "noise",
        "versions": {"kvtrim": "0.1.0"},
        "kept_fraction": 1.0 if ratio is None else 1 - ratio,
        "kv_bytes_after": 2**20 if ratio is None else int(2**20 * (1 - ratio)),
        "compress_s": 0.0 if ratio is None else 0.004,
        "decode_ms_per_token": 20.0,
        "meta": {},
    }
    base.update(extra)
    return base


def _write(out: Path, records: list[dict]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


HAND = [
    _rec("passkey", 0, "full", None, 1.0),
    _rec("passkey", 1, "full", None, 1.0),
    _rec("vt", 0, "full", None, 0.5),
    _rec("vt", 1, "full", None, 0.5),
    _rec("passkey", 0, "snapkv", 0.5, 1.0),
    _rec("passkey", 1, "snapkv", 0.5, 0.0),
    _rec("vt", 0, "snapkv", 0.5, 0.0),
    _rec("vt", 1, "snapkv", 0.5, 0.5),
    _rec("passkey", 0, "snapkv", 0.75, 0.0),
    _rec("passkey", 0, "h2o", 0.5, 1.0, mode="question-aware"),
    _rec("passkey", 0, "full", None, 1.0, mode="question-aware"),
]


def _row(text: str, section: str, method: str, ratio: str) -> list[str]:
    part = text.split(section, 1)[1].split("\n## ", 1)[0]
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[:2] == [method, ratio]:
            return cells
    raise AssertionError(f"no row {method} {ratio} in {section}")


def test_report_tables_from_hand_written_records(tmp_path):
    out = _write(tmp_path / "run", HAND)
    text = build_report(out)
    assert "## context-only" in text and "## question-aware" in text
    assert "| method | ratio / budget | passkey | vt | average | Δ avg vs full | kept % | KV MiB |" in text
    full = _row(text, "## context-only", "full", "-")
    assert full[2:5] == ["100.0", "50.0", "75.0"] and full[-1] == "2"
    snap = _row(text, "## context-only", "snapkv", "0.5")
    assert snap[2:6] == ["50.0", "25.0", "37.5", "-37.5"]
    assert snap[6:10] == ["50.0", "0.50", "4.0", "20.0"]
    partial = _row(text, "## context-only", "snapkv", "0.75")
    assert partial[2:6] == ["0.0", "-", "0.0*", "-100.0"] and partial[-1] == "1"  # Δ on the same tasks
    lines = text.split("## context-only", 1)[1].splitlines()
    order = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and "method" not in line]
    assert order[:3] == ["full", "snapkv", "snapkv"]
    qa = _row(text, "## question-aware", "h2o", "0.5")
    assert qa[2] == "100.0" and qa[3] == "-"
    assert (out / "summary.md").read_text() == text
    assert (out / SUMMARY_FILE).is_file()
    for name in ("score_vs_ratio_passkey.png", "score_vs_ratio_vt.png"):
        assert (out / "plots" / name).read_bytes()[:4] == PNG
        assert f"plots/{name}" in text


def test_several_lengths_get_their_own_columns(tmp_path):
    records = [_rec("vt", 0, "full", None, 1.0, length=512), _rec("vt", 0, "full", None, 0.0, length=1024)]
    text = build_report(_write(tmp_path / "run", records), plots=False)
    assert "| vt@512 | vt@1024 |" in text and "plots/" not in text
    assert not (tmp_path / "run" / "plots").exists()


def test_needle_heatmaps_from_hand_written_records(tmp_path):
    records = []
    for method, ratio in [("full", None), ("snapkv", 0.5)]:
        for i, (length, depth) in enumerate([(1000, 0), (1000, 100), (2000, 0), (2000, 100)]):
            meta = {"depth_percent": depth, "context_length": length}
            records.append(_rec("needle", i % 2, method, ratio, i / 3, length=length, meta=meta))
    out = _write(tmp_path / "run", records)
    text = build_report(out)
    for name in ("needle_heatmap_full.png", "needle_heatmap_snapkv_0.5.png", "score_vs_ratio_needle.png"):
        assert (out / "plots" / name).read_bytes()[:4] == PNG
        assert name in text
    assert "needle@" not in text  # the needle grid is one column, averaged over lengths


def test_report_of_a_real_sweep_with_a_needle_grid(tmp_path, jargon_text):
    out = run_sweep(
        (tiny_model("llama"), byte_tokenizer()),
        ["needle"],
        ["snapkv"],
        [0.5],
        length=400,
        samples=2,
        out_dir=tmp_path / "run",
        lengths=[360, 420],
        max_new_tokens=3,
        progress=False,
    )
    records = load_records(out)
    assert len(records) == 2 * 2 * 2  # lengths × depths × (full, snapkv 0.5)
    assert {(r["length"], r["meta"]["depth_percent"]) for r in records} == {(360, 0), (360, 100), (420, 0), (420, 100)}
    assert all(r["stop_on_newline"] and "needle_rouge1" in r["secondary_scores"] for r in records)
    assert all(r["haystack_info"]["name"] == "jargon" for r in records)
    text = build_report(out)
    assert (out / "plots" / "needle_heatmap_snapkv_0.5.png").is_file()
    assert "| needle |" in text


def test_report_errors(tmp_path):
    with pytest.raises(InvalidParameterError, match="not a directory"):
        build_report(tmp_path / "missing")
    with pytest.raises(InvalidParameterError, match="no records"):
        build_report(tmp_path)


def test_report_cli(tmp_path):
    out = _write(tmp_path / "run", HAND)
    result = cli.invoke(app, ["report", str(out), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "| full | - | 100.0 | 50.0 |" in result.output
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        result = cli.invoke(app, ["report", str(bad)])
        assert result.exit_code == 2 and "error:" in result.output


def test_single_ratio_plot_has_a_sensible_axis(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (seen.append(fig), close(fig)))
    records = [_rec("passkey", 0, "full", None, 1.0)]
    records += [_rec("passkey", 0, m, 0.5, s) for m, s in (("snapkv", 1.0), ("tova", 0.0), ("knorm", 0.0))]
    build_report(_write(tmp_path / "run", records))
    axes = [ax for fig in seen if fig is not None for ax in fig.axes if "ratio" in ax.get_xlabel()]
    assert axes
    lo, hi = axes[0].get_xlim()
    assert lo <= 0.4 and hi >= 0.6  # not 0.498-0.502
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["0.5"]


def test_header_threads_and_layout_come_from_run_json(tmp_path):
    out = _write(tmp_path / "run", [_rec("passkey", 0, "full", None, 1.0, prompt_format="kvpress")])
    run = {"runs": [{"threads": None, "wall_s": 60.0, "records_written": 1, "status": "finished",
                     "environment": {"torch_threads": 2, "cpu_count": 2}}]}  # fmt: skip
    (out / "run.json").write_text(json.dumps(run))
    text = build_report(out, plots=False)
    assert "torch threads: 2;" in text
    assert "prompt layout: kvpress" in text
    assert "entries (`kv_quant`): none (the model's dtype)" in text


def test_header_names_the_resolved_kv_quant_of_the_records(tmp_path):
    records = [_rec("passkey", 0, "full", None, 1.0, kv_quant="int4:group_size=32,residual=32")]
    text = build_report(_write(tmp_path / "run", records), plots=False)
    assert "entries (`kv_quant`): int4:group_size=32,residual=32" in text


def test_report_reads_gzipped_records_and_records_appended_after_them(tmp_path):
    import gzip

    out = tmp_path / "run"
    out.mkdir()
    with gzip.open(out / (RECORDS_FILE + ".gz"), "wt", encoding="utf-8") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in HAND[:-2]))
    (out / RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in HAND[-2:]))
    assert load_records(out) == HAND
    assert load_records(out / RECORDS_FILE) == HAND
    plain = build_report(_write(tmp_path / "plain", HAND), plots=False)
    assert build_report(out, plots=False).split("\n", 1)[1] == plain.split("\n", 1)[1]
