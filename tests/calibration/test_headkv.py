"""HeadKV retrieval-reasoning head detection, its artifact and the `kvtrim calibrate` commands."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from conftest import byte_tokenizer, tiny_model
from kvtrim.artifacts.store import load_artifact, model_key
from kvtrim.calibration.cli import calibrate_app
from kvtrim.calibration.headkv import (
    DEFAULT_NEEDLES,
    NeedleSpec,
    calibrate_headkv,
    depth_grid,
    detect_heads,
    two_fact_needles,
)
from kvtrim.errors import InvalidParameterError, KVTrimError

runner = CliRunner()
NEEDLES = two_fact_needles(("Mary", 13, "her", "swimming"), ("John", 12, "his", "chess"), True, "m")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path / "home"))


@pytest.fixture(autouse=True)
def single_thread():
    """Decoding many one-token steps is dominated by thread hand-offs on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_default_needles_are_consistent():
    assert {n.kind for n in DEFAULT_NEEDLES} == {"reasoning", "direct"}
    for spec in DEFAULT_NEEDLES:
        assert spec.span in spec.needle and spec.answer in spec.span
    reasoning = NEEDLES[0]
    assert reasoning.question == "What is the favorite thing of the older one between John and Mary?"
    assert reasoning.span == "Mary is 13 years old and her favorite thing is swimming."
    assert depth_grid(10) == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
    with pytest.raises(InvalidParameterError):
        depth_grid([120])


def test_detect_heads_on_tiny_model(tokenizer):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    det = detect_heads(model, tokenizer, [160, 220], 2, NEEDLES, haystack="noise", min_f1=-1, progress=False)
    assert det.n_tests == 2 * 2 * 2 and det.n_kept == det.n_tests
    assert det.retrieval_reasoning.shape == (2, 4) and det.retrieval.shape == (2, 4)
    assert det.per_test_retrieval_reasoning.shape == (8, 2, 4)
    assert bool(torch.isfinite(det.retrieval_reasoning).all()) and float(det.retrieval_reasoning.sum()) > 0
    torch.testing.assert_close(det.retrieval_reasoning, det.per_test_retrieval_reasoning.mean(0))
    # each step adds at most 1/|answer tokens| per head, so a test's score is at most 1
    assert float(det.per_test_retrieval_reasoning.max()) <= 1.0 + 1e-6
    rec = det.records[0]
    start, end = rec["span"]
    assert 0 < start < end < rec["prompt_tokens"]
    assert model.config._attn_implementation != "eager"  # restored
    assert det.kept_by_kind() == {"reasoning": [4, 4], "direct": [4, 4]}


def test_span_points_at_the_answer_sentence():
    tok = byte_tokenizer()
    model = tiny_model("llama", layers=1, heads=2, kv_heads=1)
    det = detect_heads(model, tok, [200], [50], NEEDLES[:1], haystack="noise", min_f1=-1, progress=False)
    start, end = det.records[0]["span"]
    assert end - start == len(NEEDLES[0].span.encode())  # one token per byte


def test_calibrate_saves_loadable_artifact(tokenizer, tmp_path):
    model = tiny_model("qwen2", layers=2, heads=4, kv_heads=2)
    path = calibrate_headkv(
        model,
        tokenizer,
        lengths=[180],
        depths=2,
        out_dir=tmp_path,
        min_f1=-1,
        needles=NEEDLES,
        haystack="noise",
        progress=False,
    )
    assert path == tmp_path / model_key(model) / "headkv.safetensors"
    art = load_artifact("headkv", model, tmp_path)
    assert art.tensors["retrieval_reasoning"].shape == (2, 4) and art.tensors["retrieval"].dtype == torch.float32
    assert art.tensors["tests_kept"].dtype == torch.bool and art.tensors["tests_kept"].numel() == 4
    assert art.meta["summary"]["tests"] == 4 and art.meta["summary"]["kept"] == 4
    assert art.meta["settings"]["lengths"] == [180] and art.meta["settings"]["depths"] == [0.0, 100.0]
    assert art.meta["seconds"] >= 0 and len(art.meta["tests"]) == 4


def test_calibrate_refuses_when_nothing_kept(tokenizer, tmp_path):
    model = tiny_model("llama", layers=1, heads=2, kv_heads=1)
    with pytest.raises(KVTrimError, match="kept none"):
        calibrate_headkv(
            model, tokenizer, [150], [0], out_dir=tmp_path, needles=NEEDLES[:1], haystack="noise", progress=False
        )


def test_bad_needle_rejected(tokenizer):
    bad = NeedleSpec("x", needle=" A is 1.", span="B is 2.", question="q?", answer="a")
    with pytest.raises(InvalidParameterError, match="span"):
        detect_heads(tiny_model(), tokenizer, [150], 1, [bad], haystack="noise", progress=False)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", layers=2, heads=4, kv_heads=2).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_cli_headkv_and_show(saved_model, tmp_path):
    out_dir = tmp_path / "arts"
    result = runner.invoke(
        calibrate_app,
        [
            "headkv",
            "--model",
            str(saved_model),
            "--lengths",
            "170",
            "--depths",
            "1",
            "--min-f1=-1",
            "--haystack",
            "noise",
            "--out",
            str(out_dir),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "headkv artifact:" in result.output and "wall time:" in result.output
    png = tmp_path / "heat.png"
    shown = runner.invoke(
        calibrate_app, ["show", "--model", str(saved_model), "--path", str(out_dir), "--plot", str(png)]
    )
    assert shown.exit_code == 0, shown.output
    assert "headkv artifact" in shown.output and "retrieval_reasoning: 2x4" in shown.output
    assert png.stat().st_size > 1000


def test_cli_show_missing_artifact_exits_2(saved_model):
    result = runner.invoke(calibrate_app, ["show", "--model", str(saved_model)])
    assert result.exit_code == 2
    assert "error:" in result.output and "kvtrim calibrate headkv --model" in result.output


def test_cli_rejects_bad_lengths(saved_model):
    result = runner.invoke(calibrate_app, ["headkv", "--model", str(saved_model), "--lengths", "a,b"])
    assert result.exit_code == 2 and "lengths" in result.output


@pytest.mark.slow
def test_shipped_artifact_loads_for_embedded_model(smollm2, monkeypatch, tmp_path):
    from kvtrim.budgets.head_scores import HeadScoreBudget

    model, _ = smollm2
    art = load_artifact("headkv", model)
    assert art.source == "package"
    assert art.tensors["retrieval_reasoning"].shape == (30, 9)
    assert art.meta["summary"]["kept"] > 0
    budget = HeadScoreBudget.from_artifact(model)
    assert budget.head_scores.shape == (30, 9)
