"""CompressKV calibration: SRH (eq. 5) / TRH head scores, the layer error profile, the artifact and the CLI."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import kvtrim.calibration.compresskv as ckv
import kvtrim.calibration.needles as needles
from conftest import byte_tokenizer, tiny_model
from kvtrim.artifacts.store import load_artifact, model_key
from kvtrim.calibration.cli import calibrate_app
from kvtrim.calibration.compresskv import (
    AnswerNeedle,
    calibrate_compresskv,
    detect_retrieval_heads,
    find_answer_span,
    normalize_layer_errors,
    profile_layer_errors,
    rouge1_recall,
    srh_step_scores,
    trh_step_scores,
)
from kvtrim.errors import InvalidParameterError, KVTrimError

runner = CliRunner()
NEEDLE = AnswerNeedle(
    "cake",
    " The best cake in the village is baked by Anna with wild plums.",
    "baked by Anna with wild plums",
    "Who bakes the best cake in the village?",
    "The best cake in the village is",
)


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path / "home"))


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _attention() -> torch.Tensor:
    """[2 layers, 2 heads, 8 keys]; the answer span is [3, 6)."""
    att = torch.zeros(2, 2, 8)
    att[0, 0] = torch.tensor([0.1, 0.0, 0.0, 0.2, 0.3, 0.1, 0.2, 0.1])  # span mass 0.6, top-1 at 4 (inside)
    att[0, 1] = torch.tensor([0.7, 0.0, 0.0, 0.1, 0.0, 0.1, 0.1, 0.0])  # span mass 0.2, top-1 at 0 (outside)
    att[1, 0] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.9, 0.1, 0.0])  # span mass 0.9, top-1 at 5 (inside)
    att[1, 1] = torch.full((8,), 0.125)  # span mass 0.375, top-1 at 0 (ties: first)
    return att


def test_srh_step_adds_span_mass_once_per_matching_position():
    prompt = torch.tensor([10, 11, 12, 20, 21, 20, 13, 14])  # token 20 appears twice in the span [3, 6)
    att = _attention()
    once = srh_step_scores(att, 21, prompt, (3, 6))
    torch.testing.assert_close(once, torch.tensor([[0.6, 0.2], [0.9, 0.375]]))
    twice = srh_step_scores(att, 20, prompt, (3, 6))
    torch.testing.assert_close(twice, 2 * once)
    assert bool((srh_step_scores(att, 12, prompt, (3, 6)) == 0).all())  # in the prompt, not in the span
    assert bool((srh_step_scores(att, 99, prompt, (3, 6)) == 0).all())


def test_trh_step_needs_top1_inside_and_a_copy():
    prompt = torch.tensor([10, 11, 12, 20, 21, 22, 13, 14])
    att = _attention()
    # token 21 sits at position 4: only head (0, 0) attends most to it
    torch.testing.assert_close(trh_step_scores(att, 21, prompt, (3, 6)), torch.tensor([[1 / 3, 0.0], [0.0, 0.0]]))
    # token 22 sits at 5: head (1, 0)
    torch.testing.assert_close(trh_step_scores(att, 22, prompt, (3, 6)), torch.tensor([[0.0, 0.0], [1 / 3, 0.0]]))
    # top-1 at position 0 holds token 10 but lies outside the span
    assert bool((trh_step_scores(att, 10, prompt, (3, 6)) == 0).all())
    # keys beyond the prompt (generated tokens) are never inside the span
    longer = torch.cat([att, torch.zeros(2, 2, 1)], -1)
    longer[0, 0, 8] = 5.0
    assert float(trh_step_scores(longer, 21, prompt, (3, 6))[0, 0]) == 0.0


def test_find_answer_span_token_set_overlap():
    prompt = [5, 6, 7, 1, 2, 3, 4, 9, 1, 2, 3, 4]
    assert find_answer_span(prompt, [1, 2, 3, 4]) == (3, 7)  # the first window wins
    assert find_answer_span(prompt, [2, 1, 4, 3]) == (3, 7)  # a token set: order does not matter
    assert find_answer_span(prompt, [1, 2, 3, 8]) is None  # 3/4 = 0.75 <= 0.9
    assert find_answer_span(prompt, []) is None


def test_rouge1_recall():
    assert rouge1_recall("Anna bakes it with wild plums.", "baked by Anna with wild plums") == pytest.approx(5 / 6)
    assert rouge1_recall("I do not know", "baked by Anna with wild plums") == 0.0
    assert rouge1_recall("  ", "anything") == 0.0


def test_only_successful_tests_count(tokenizer, monkeypatch):
    """Fake decoding: even tests answer correctly (copying a span token with known attention), odd ones do not."""
    model = tiny_model("llama", layers=2, heads=2, kv_heads=1)
    calls = {"n": 0}

    def fake_decode(model, tokenizer, ids, steps, eos, newline, on_step):
        i = calls["n"]
        calls["n"] += 1
        span = ckv.answer_span(tokenizer, ids, NEEDLE.answer)
        att = torch.zeros(2, 2, len(ids))
        att[..., span[0]] = 0.5 + i  # the first span token gets the top attention
        token = ids[span[0]]
        calls.setdefault("count", []).append(ids[span[0] : span[1]].count(token))
        on_step(token, att)
        text = NEEDLE.answer if i % 2 == 0 else "no idea at all"
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    monkeypatch.setattr(needles, "greedy_decode_with_attention", fake_decode)  # the shared detection loop
    found = detect_retrieval_heads(model, tokenizer, [200], 4, [NEEDLE], haystack="noise", progress=False)
    assert found.n_tests == 4 and found.success.tolist() == [True, False, True, False]
    assert found.recall.tolist() == [1.0, 0.0, 1.0, 0.0]
    # test i: SRH (0.5 + i) * (times the copied token occurs in the span), TRH 1/|span|, on every head
    count = calls["count"][0]
    assert count > 1 and calls["count"] == [count] * 4  # the first span token (a space) repeats in the span
    torch.testing.assert_close(found.per_test_srh[:, 0, 0], torch.tensor([0.5, 1.5, 2.5, 3.5]) * count)
    torch.testing.assert_close(found.srh, torch.full((2, 2), (0.5 + 2.5) / 2 * count))
    s, e = found.records[0]["span"]
    torch.testing.assert_close(found.trh, torch.full((2, 2), 1 / (e - s)))


def test_detect_on_tiny_model_finds_the_span(tokenizer):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    found = detect_retrieval_heads(
        model, tokenizer, [160, 220], 2, [NEEDLE], haystack="noise", min_recall=-1, max_new_tokens=6, progress=False
    )
    assert found.n_tests == 4 and found.n_success == 4
    assert found.srh.shape == (2, 4) and found.per_test_trh.shape == (4, 2, 4)
    rec = found.records[0]
    s, e = rec["span"]
    assert e - s == len(NEEDLE.answer) + 1 or e - s == len(NEEDLE.answer)  # one token per byte (+ leading space)
    assert model.config._attn_implementation != "eager"  # restored
    with pytest.raises(InvalidParameterError, match="answer"):
        bad = AnswerNeedle("x", " A is 1.", "B", "q?")
        detect_retrieval_heads(model, tokenizer, [150], 1, [bad], haystack="noise", progress=False)


def test_normalize_layer_errors():
    per_task = torch.tensor([[1.0, 3.0], [2.0, 2.0], [0.0, 0.0]])
    # rows -> [0.25, 0.75] and [0.5, 0.5]; the all-zero task is skipped; mean [0.375, 0.625]
    torch.testing.assert_close(normalize_layer_errors(per_task), torch.tensor([0.375, 0.625], dtype=torch.float64))
    with pytest.raises(KVTrimError):
        normalize_layer_errors(torch.zeros(2, 3))


def test_profile_layer_errors_on_tiny_model(tokenizer):
    model = tiny_model("qwen2", layers=3, heads=4, kv_heads=2)
    heads = torch.tensor([[0, 1], [2, 3], [1, 3]])
    prof = profile_layer_errors(model, tokenizer, heads, ["passkey"], samples=1, length=300, progress=False)
    assert prof.layer_scores.shape == (3,)
    assert float(prof.layer_scores.sum()) == pytest.approx(1.0, abs=1e-5)
    assert bool((prof.per_task > 0).all())  # 300 tokens compressed to 32: every layer errs
    assert prof.records[0]["decode_steps"] > 0 and prof.settings["budget"] == 32


def test_calibrate_saves_loadable_artifact(tokenizer, tmp_path):
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    path = calibrate_compresskv(
        model,
        tokenizer,
        lengths=[160],
        depths=2,
        needles=[NEEDLE],
        haystack="noise",
        min_recall=-1,
        max_new_tokens=4,
        tasks=["passkey"],
        task_samples=1,
        task_length=300,
        heads_per_layer=2,
        out_dir=tmp_path,
        progress=False,
    )
    assert path == tmp_path / model_key(model) / "compresskv.safetensors"
    art = load_artifact("compresskv", model, tmp_path)
    assert art.tensors["srh"].shape == (2, 4) and art.tensors["trh"].dtype == torch.float32
    assert art.tensors["layer_scores"].shape == (2,)
    assert float(art.tensors["layer_scores"].sum()) == pytest.approx(1.0, abs=1e-5)
    assert art.tensors["srh_ranking"].shape == (2, 4) and art.tensors["test_success"].numel() == 2
    summary = art.meta["summary"]
    assert summary["tests"] == 2 and summary["successes"] == 2 and summary["profile_prompts"] == 1
    assert art.meta["settings"]["heads"]["lengths"] == [160] and art.meta["seconds"] >= 0
    assert len(art.meta["tests"]) == 2


def test_calibrate_refuses_when_nothing_succeeds(tokenizer, tmp_path):
    model = tiny_model("llama", layers=1, heads=2, kv_heads=1)
    with pytest.raises(KVTrimError, match="none of its"):
        calibrate_compresskv(
            model,
            tokenizer,
            [150],
            [0],
            [NEEDLE],
            haystack="noise",
            max_new_tokens=3,
            out_dir=tmp_path,
            progress=False,
        )


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-ckv")
    tiny_model("llama", layers=2, heads=4, kv_heads=2).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_cli_compresskv_and_show(saved_model, tmp_path, monkeypatch):
    monkeypatch.setattr(ckv, "DEFAULT_NEEDLES", (NEEDLE,))
    out_dir = tmp_path / "arts"
    args = ["compresskv", "--model", str(saved_model), "--lengths", "170", "--depths", "1", "--min-recall=-1"]
    args += ["--max-new-tokens", "3", "--haystack", "noise", "--tasks", "passkey", "--task-samples", "1"]
    args += ["--task-length", "300", "--out", str(out_dir), "--no-progress", "--threads", "1"]
    result = runner.invoke(calibrate_app, args)
    assert result.exit_code == 0, result.output
    assert "compresskv artifact:" in result.output and "needle tests succeeded: 1/1" in result.output
    png = tmp_path / "ckv.png"
    shown = runner.invoke(
        calibrate_app,
        ["show", "--model", str(saved_model), "--kind", "compresskv", "--path", str(out_dir), "--plot", str(png)],
    )
    assert shown.exit_code == 0, shown.output
    assert "compresskv artifact" in shown.output and "srh: 2x4" in shown.output and "layer_scores: 2" in shown.output
    assert png.stat().st_size > 1000
    missing = runner.invoke(calibrate_app, ["show", "--model", str(saved_model), "--kind", "compresskv"])
    assert missing.exit_code == 2 and "kvtrim calibrate compresskv --model" in missing.output
