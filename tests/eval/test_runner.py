"""The sweep runner: records, resume, aggregation and the ``kvtrim eval`` command (tiny random models)."""

from __future__ import annotations

import csv
import gc
import json
import os
import shutil
import signal
import weakref
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import byte_tokenizer, tiny_model
from kvtrim.api import GenerationStats, Result
from kvtrim.cli import app
from kvtrim.errors import InvalidParameterError
from kvtrim.eval import runner as runner_mod
from kvtrim.eval.runner import (
    RECORDS_FILE,
    RUN_FILE,
    SUMMARY_FILE,
    load_records,
    record_key,
    run_sweep,
    summarize,
    write_summary,
)
from kvtrim.eval.tasks import Sample

cli = CliRunner()
LENGTH = 640  # niah_single_1 reserves 128 generated tokens; with the byte tokenizer it needs ~580 tokens
TASKS = ["passkey", "niah_single_1"]
METHODS = ["snapkv", "streaming_llm"]
RATIOS = [0.5, 0.75]
CONFIGS = 1 + len(METHODS) * len(RATIOS)  # the full cache plus every (method, ratio)
FIELDS = {
    "task",
    "index",
    "seed",
    "length",
    "mode",
    "question_aware",
    "method",
    "ratio",
    "budget",
    "prediction",
    "raw_prediction",
    "answers",
    "metric",
    "score",
    "secondary_scores",
    "full_score",
    "context_tokens",
    "kv_entries_before",
    "kv_entries_after",
    "kv_bytes_before",
    "kv_bytes_after",
    "kept_fraction",
    "prefill_s",
    "compress_s",
    "decode_ms_per_token",
    "model",
    "versions",
    "metric_versions",
    "haystack",
    "haystack_info",
    "meta",
    "method_preset",
    "method_params",
    "key",
}


@pytest.fixture(scope="module")
def pair():
    return tiny_model("llama"), byte_tokenizer()


def _sweep(pair, out: Path, **kw):
    args = dict(
        tasks=TASKS,
        methods=METHODS,
        ratios=RATIOS,
        length=LENGTH,
        samples=2,
        out_dir=out,
        max_new_tokens=4,
        progress=False,
        model_label="tiny-llama",
    )
    args.update(kw)
    return run_sweep(pair, **args)


@pytest.fixture(scope="module")
def swept(pair, tmp_path_factory) -> Path:
    return _sweep(pair, tmp_path_factory.mktemp("sweep"))


@pytest.fixture
def count_prefills(monkeypatch) -> list[int]:
    """Counts the :class:`~kvtrim.api.Session` prefills the runner makes."""
    calls: list[int] = []
    real = runner_mod.Session

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "Session", counting)
    return calls


# ---------------------------------------------------------------------------------------------------- records
def test_records_have_all_fields(swept):
    records = load_records(swept)
    assert len(records) == len(TASKS) * 2 * CONFIGS
    assert len({r["key"] for r in records}) == len(records)
    for r in records:
        assert set(r) >= FIELDS, FIELDS - set(r)
        assert r["key"] == record_key(r)
        assert r["mode"] == "context-only" and r["question_aware"] is False
        assert r["model"] == "tiny-llama" and r["length"] == LENGTH
        assert set(r["versions"]) == {"kvtrim", "torch", "transformers"}
        assert r["max_new_tokens"] == 4
        assert 0.0 <= r["score"] <= 1.0
    full = {(r["task"], r["index"]): r for r in records if r["method"] == "full"}
    assert len(full) == len(TASKS) * 2
    for r in records:
        ref = full[(r["task"], r["index"])]
        assert r["full_score"] == ref["score"]  # one full run per sample, reused by every ratio
        assert r["prefill_s"] == ref["prefill_s"]  # the same prefill served every config
        if r["method"] == "full":
            assert r["ratio"] is None and r["budget"] is None and r["kept_fraction"] == 1.0
        else:
            assert r["kept_fraction"] == pytest.approx(1 - r["ratio"], abs=0.02)
            assert r["method_params"] and r["method_preset"]
    niah = next(r for r in records if r["task"] == "niah_single_1")
    assert niah["haystack"] == niah["meta"]["haystack"] and niah["haystack_info"]["sha256"]


def test_run_file_and_summary(swept):
    run = json.loads((swept / RUN_FILE).read_text())
    (entry,) = run["runs"]
    assert entry["tasks"] == TASKS and entry["methods"] == METHODS and entry["ratios"] == RATIOS
    assert entry["mode"] == "context-only" and entry["records_written"] == len(TASKS) * 2 * CONFIGS
    assert entry["wall_s"] > 0 and entry["environment"]["torch"]
    assert entry["status"] == "finished" and entry["finished"]
    with (swept / SUMMARY_FILE).open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(TASKS) * CONFIGS
    assert all(row["n"] == "2" for row in rows)
    assert [row["method"] for row in rows[:CONFIGS]] == ["full", "streaming_llm", "streaming_llm", "snapkv", "snapkv"]


def test_resume_skips_finished_records(pair, swept, tmp_path, count_prefills):
    out = tmp_path / "resume"
    shutil.copytree(swept, out)
    path = out / RECORDS_FILE
    lines = path.read_text().splitlines()
    kept = lines[:-2]  # the last sample lost two records, and the crash tore the next line
    path.write_text("\n".join(kept) + "\n" + lines[-2][:25])
    _sweep(pair, out)
    assert len(count_prefills) == 1  # only the unfinished sample is prefilled again
    records = load_records(out)
    assert len(records) == len(lines)
    assert sorted(r["key"] for r in records) == sorted(json.loads(line)["key"] for line in lines)
    assert path.read_text().splitlines()[: len(kept)] == kept  # finished records are untouched
    _sweep(pair, out)
    assert len(count_prefills) == 1  # everything done: nothing is prefilled
    runs = json.loads((out / RUN_FILE).read_text())["runs"]
    assert [r["records_written"] for r in runs] == [len(lines), 2, 0]
    assert runs[1]["torn_lines_dropped"] == 1


def test_sigterm_records_the_interrupted_run(pair, tmp_path, monkeypatch):
    real = runner_mod._run_one
    calls: list[int] = []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 8:  # in the second sample, after its first few records
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "_run_one", dying)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit):
        _sweep(pair, tmp_path / "killed", tasks=["passkey"], length=300)
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
    (entry,) = json.loads((tmp_path / "killed" / RUN_FILE).read_text())["runs"]
    assert entry["status"] == "interrupted" and entry["finished"] is None and entry["wall_s"] > 0
    records = load_records(tmp_path / "killed")
    assert entry["records_written"] == len(records) == 7  # the record in progress is lost, nothing else


def test_cache_clones_are_freed_during_the_sweep(pair, tmp_path, monkeypatch):
    """KVTrimCache <-> layer reference cycles: the runner collects them itself (else a sweep grows to GBs)."""
    from kvtrim.integration.cache import KVTrimCache

    clones: list[weakref.ref] = []
    real_clone = KVTrimCache.clone

    def tracking(self, *args, **kwargs):
        other = real_clone(self, *args, **kwargs)
        clones.append(weakref.ref(other))
        return other

    monkeypatch.setattr(KVTrimCache, "clone", tracking)
    gc.disable()
    try:
        _sweep(pair, tmp_path / "gc", tasks=["passkey"], length=300)
        assert len(clones) == 2 * CONFIGS and all(ref() is None for ref in clones)
    finally:
        gc.enable()


def test_question_aware_and_budgets_are_new_records(pair, swept, tmp_path):
    out = tmp_path / "modes"
    shutil.copytree(swept, out)
    _sweep(pair, out, tasks=["passkey"], methods=["snapkv"], ratios=None, budgets=[16], samples=1, question_aware=True)
    records = load_records(out)
    new = [r for r in records if r["mode"] == "question-aware"]
    assert len(new) == 2 and {r["method"] for r in new} == {"full", "snapkv"}
    budgeted = next(r for r in new if r["method"] == "snapkv")
    assert budgeted["budget"] == 16 and budgeted["ratio"] is None and budgeted["question_aware"] is True
    assert budgeted["kv_entries_after"] == 16 * 2 * 2  # budget × layers × KV heads
    assert len(records) == len(TASKS) * 2 * CONFIGS + 2


def test_mismatched_directory_is_refused(pair, swept, tmp_path):
    out = tmp_path / "other"
    shutil.copytree(swept, out)
    with pytest.raises(InvalidParameterError, match="seed"):
        _sweep(pair, out, seed=7)


def test_prompt_layout_is_recorded_and_not_mixed(pair, swept, tmp_path):
    assert {r["prompt_format"] for r in load_records(swept)} == {"kvtrim"}
    assert {r["separator"] for r in load_records(swept)} == {"\n\n"}
    (entry,) = json.loads((swept / RUN_FILE).read_text())["runs"]
    assert entry["prompt_format"] == "kvtrim" and entry["device"] == "cpu" and entry["dtype"] == "float32"
    out = tmp_path / "other"
    shutil.copytree(swept, out)
    with pytest.raises(InvalidParameterError, match="prompt_format='kvtrim', this one has prompt_format='kvpress'"):
        _sweep(pair, out, prompt_format="kvpress")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tasks": ["nope"]}, "unknown task"),
        ({"methods": ["nope"]}, "unknown"),
        ({"methods": ["full"]}, "always run"),
        ({"ratios": [1.0]}, "ratio"),
        ({"ratios": None}, "ratios and/or budgets"),
        ({"budgets": [0]}, "budget"),
        ({"samples": 0}, "samples"),
        ({"task_options": {"vt": {}}}, "not in the sweep"),
        ({"threads": 0}, "threads"),
        ({"prompt_format": "vllm"}, "prompt_format must be one of"),
    ],
)
def test_invalid_arguments(pair, tmp_path, kw, message):
    with pytest.raises(InvalidParameterError, match=message):
        _sweep(pair, tmp_path / "bad", **kw)
    assert not (tmp_path / "bad" / RECORDS_FILE).exists()


def test_model_must_be_name_or_pair(tmp_path):
    with pytest.raises(InvalidParameterError, match="model"):
        run_sweep(object(), ["passkey"], ["snapkv"], [0.5], out_dir=tmp_path, progress=False)


# ---------------------------------------------------------------------------------------------------- scoring rules
class FakeSession:
    """Returns a fixed raw answer with plausible stats."""

    def __init__(self, answer: str):
        self.answer = answer

    def run(self, method, ratio=None, budget=None, questions=None, max_new_tokens=64, kv_quant=None):
        stats = GenerationStats(method, ratio, budget, False, 10, 40, 20, 400, 200, 0.1, 0.01, 0.02, 0.3, 3)
        return Result(answers=[self.answer], stats=stats)


def _needle_sample(meta: dict) -> Sample:
    return Sample("needle", "ctx", "q", "", ["eat a sandwich"], "needle_recall", 30, 0, 0, meta)


def test_stop_on_newline_cuts_before_scoring():
    sample = _needle_sample({"stop_on_newline": True, "secondary_metrics": ["needle_rouge1"]})
    cfg = runner_mod._Config("snapkv", 0.5, None)
    record = runner_mod._run_one(FakeSession("eat a\nsandwich"), sample, cfg, False, 400, None)
    assert record["prediction"] == "eat a" and record["raw_prediction"] == "eat a\nsandwich"
    assert record["score"] == pytest.approx(2 / 3)
    assert set(record["secondary_scores"]) == {"needle_rouge1"} and record["secondary_scores"]["needle_rouge1"] > 0
    assert record["decode_ms_per_token"] == pytest.approx(100.0)
    plain = runner_mod._run_one(FakeSession("eat a\nsandwich"), _needle_sample({}), cfg, False, 400, None)
    assert plain["score"] == 1.0 and plain["secondary_scores"] == {}


# ---------------------------------------------------------------------------------------------------- aggregation
def _rec(task, index, method, ratio, score, mode="context-only", **extra):
    base = {
        "task": task,
        "index": index,
        "method": method,
        "ratio": ratio,
        "budget": None,
        "mode": mode,
        "length": 1024,
        "score": score,
        "kept_fraction": 1.0 if ratio is None else 1 - ratio,
        "kv_bytes_after": 2**20,
        "compress_s": 0.002,
        "decode_ms_per_token": 10.0,
        "prefill_s": 1.0,
        "context_tokens": 900,
    }
    base.update(extra)
    return base


HAND = [
    _rec("passkey", 0, "full", None, 1.0),
    _rec("passkey", 1, "full", None, 0.0),
    _rec("passkey", 0, "snapkv", 0.5, 1.0, full_score=1.0),
    _rec("passkey", 1, "snapkv", 0.5, 1.0, full_score=0.0),
    _rec("passkey", 0, "snapkv", 0.9, 0.0, full_score=1.0, decode_ms_per_token=None),
    _rec("vt", 0, "full", None, 0.4, secondary_scores={"x": 0.5}),
    _rec("vt", 0, "full", None, 0.2, mode="question-aware"),
]


def test_summarize_hand_written_records():
    rows = summarize(HAND)
    keyed = {(r["mode"], r["task"], r["method"], r["ratio"]): r for r in rows}
    assert len(rows) == 5
    full = keyed[("context-only", "passkey", "full", None)]
    assert full["n"] == 2 and full["score"] == 50.0 and full["score_sem"] == 50.0
    snap = keyed[("context-only", "passkey", "snapkv", 0.5)]
    assert snap["score"] == 100.0 and snap["full_score"] == 50.0 and snap["kept_pct"] == 50.0
    assert snap["kv_mib"] == 1.0 and snap["compress_ms"] == 2.0 and snap["decode_ms_per_token"] == 10.0
    assert keyed[("context-only", "passkey", "snapkv", 0.9)]["decode_ms_per_token"] is None
    assert keyed[("context-only", "vt", "full", None)]["secondary:x"] == 50.0
    assert keyed[("question-aware", "vt", "full", None)]["score"] == 20.0
    assert [r["mode"] for r in rows] == ["context-only"] * 4 + ["question-aware"]


def test_write_summary_csv(tmp_path):
    (tmp_path / RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in HAND) + "{not json\n")
    path = write_summary(tmp_path)
    with path.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 5 and rows[0]["method"] == "full" and rows[0]["score"] == "50.0"
    assert "secondary:x" in rows[0]


# ---------------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "nope"], "unknown task"),
        (["--tasks", "passkey", "--ratios", "abc"], "ratios"),
        (["--tasks", "passkey", "--methods", "nope"], "unknown"),
        (["--tasks", "passkey", "--task-options", "[1]"], "JSON object"),
        (["--tasks", "passkey", "--task-options", "{bad"], "error:"),
    ],
)
def test_eval_cli_errors(tmp_path, args, message):
    out = cli.invoke(app, ["eval", "--out", str(tmp_path / "o"), *args])
    assert out.exit_code == 2
    assert "error:" in out.output and message in out.output


def test_eval_cli_runs(tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "o"
    args = ["eval", "--model", str(model_dir), "--tasks", "passkey", "--methods", "knorm", "--budgets", "32"]
    args += ["--length", "300", "--samples", "1", "--max-new-tokens", "2", "--no-progress", "--out", str(out)]
    result = cli.invoke(app, args)
    assert result.exit_code == 0, result.output
    records = load_records(out)
    assert [(r["method"], r["ratio"], r["budget"]) for r in records] == [("full", None, None), ("knorm", None, 32)]
    assert records[0]["model"] == str(model_dir)
