"""kvtrim.generate / Session: answers, stats, modes, and clear errors that change nothing."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM

import kvtrim
from conftest import random_text, tiny_model
from kvtrim.errors import InvalidParameterError, UnsupportedModelError

CTX = random_text(120, seed=11)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": -0.1}, r"ratio must be in \[0, 1\)"),
        ({"ratio": 1.0}, r"ratio must be in \[0, 1\)"),
        ({"ratio": 2}, r"ratio must be in \[0, 1\)"),
        ({"ratio": float("nan")}, "ratio must be a number"),
        ({"ratio": "0.5"}, "ratio must be a number"),
        ({"budget": 0}, "budget must be a positive integer"),
        ({"budget": -5}, "budget must be a positive integer"),
        ({"budget": 2.5}, "budget must be a positive integer"),
        ({"ratio": 0.5, "budget": 10}, "exactly one of ratio"),
        ({}, "exactly one of ratio"),
        ({"method": "nope", "ratio": 0.5}, "valid methods: .*snapkv"),
        ({"method": "full", "ratio": 0.5}, "keeps everything"),
        ({"ratio": 0.5, "method_params": {"windw": 3}}, "no parameter"),
        ({"ratio": 0.5, "max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_parameters_raise_and_change_nothing(llama, tokenizer, kwargs, match):
    before = llama.config._attn_implementation
    weights = llama.model.layers[0].self_attn.q_proj.weight.clone()
    with pytest.raises(InvalidParameterError, match=match):
        kvtrim.generate(llama, tokenizer, CTX, "q?", **kwargs)
    assert llama.config._attn_implementation == before
    assert torch.equal(weights, llama.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize(
    ("context", "questions", "match"),
    [
        ("", "q?", "context must be a non-empty string"),
        ("   ", "q?", "context must be a non-empty string"),
        (CTX, [], "questions must be a non-empty"),
        ([CTX, CTX], ["only one"], "one entry per context"),
        ([CTX, CTX], [["a", "b"], ["c"]], "same number of questions"),
    ],
)
def test_bad_inputs(llama, tokenizer, context, questions, match):
    with pytest.raises(InvalidParameterError, match=match):
        kvtrim.generate(llama, tokenizer, context, questions, ratio=0.5)


def test_question_aware_without_context_is_an_error(llama, tokenizer):
    with pytest.raises(InvalidParameterError, match="context must be a non-empty string"):
        kvtrim.generate(llama, tokenizer, "", "what?", ratio=0.5, question_aware=True)


def test_unsupported_architecture(tokenizer):
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300)).eval()
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2' is not supported; supported"):
        kvtrim.generate(gpt2, tokenizer, CTX, "q?", ratio=0.5)


def test_sliding_window_model_is_unsupported(tokenizer):
    cfg = MistralConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=64,
    )
    model = MistralForCausalLM(cfg).eval()
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        kvtrim.generate(model, tokenizer, CTX, "q?", ratio=0.5)
    assert model.config._attn_implementation == before


def test_stats_are_measured(llama, tokenizer):
    res = kvtrim.generate(
        llama,
        tokenizer,
        CTX,
        ["q1?", "q2?"],
        method="snapkv",
        ratio=0.75,
        max_new_tokens=6,
        method_params={"window": 8},
    )
    s = res.stats
    assert len(res.answers) == 2 and all(isinstance(a, str) for a in res.answers)
    assert s.context_tokens == 120
    layers, kv_heads = 2, 2
    assert s.kv_entries_before == 120 * layers * kv_heads
    assert s.kv_entries_after == 30 * layers * kv_heads
    assert s.kv_bytes_after == s.kv_entries_after * 16 * 4 * 2
    assert s.kv_bytes_before == s.kv_entries_before * 16 * 4 * 2
    assert s.prefill_s > 0 and s.compress_s > 0
    assert s.decode_tokens > 0 and math.isfinite(s.decode_ms_per_token)
    assert s.as_dict()["decode_ms_per_token"] == s.decode_ms_per_token
    # CPU time of both questions' decoding and of the compression (a process cannot use more than its threads)
    assert 0 < s.decode_cpu_s <= s.decode_s * torch.get_num_threads() + 0.05
    assert 0 < s.compress_cpu_s <= s.compress_s * torch.get_num_threads() + 0.05
    assert s.as_dict()["decode_cpu_ms_per_token"] == s.decode_cpu_ms_per_token
    assert s.decode_cpu_ms_per_token == 1000 * s.decode_cpu_s / s.decode_tokens


def test_context_only_questions_do_not_see_each_other(llama, tokenizer):
    """Each answer is removed before the next question: asking together equals asking alone."""
    together = kvtrim.generate(llama, tokenizer, CTX, ["first?", "second?"], ratio=0.5, max_new_tokens=6)
    alone = [
        kvtrim.generate(llama, tokenizer, CTX, q, ratio=0.5, max_new_tokens=6).answers[0] for q in ["first?", "second?"]
    ]
    assert together.answers == alone


def test_question_aware_compresses_the_question_too(llama, tokenizer):
    co = kvtrim.generate(llama, tokenizer, CTX, "question?", ratio=0.5, max_new_tokens=4)
    qa = kvtrim.generate(llama, tokenizer, CTX, "question?", ratio=0.5, max_new_tokens=4, question_aware=True)
    assert qa.stats.question_aware and not co.stats.question_aware
    # the question-aware prompt holds the separator and question as well
    assert qa.stats.context_tokens == co.stats.context_tokens + len("\n\nquestion?")


def test_full_method_matches_plain_greedy(tokenizer):
    model = tiny_model("qwen2")
    res = kvtrim.generate(model, tokenizer, CTX, "go", method="full", max_new_tokens=10)
    ids = tokenizer(CTX + "\n\ngo", return_tensors="pt")["input_ids"]
    ref = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=2)
    expected = tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True).strip()
    assert res.answers == [expected]


def test_session_reuses_one_prefill_for_many_methods(llama, tokenizer):
    session = kvtrim.Session(llama, tokenizer, CTX, methods=["snapkv", "h2o"])
    a = session.run("snapkv", ratio=0.5, questions="q?", max_new_tokens=4)
    b = session.run("h2o", ratio=0.5, questions="q?", max_new_tokens=4)
    direct = kvtrim.generate(llama, tokenizer, CTX, "q?", method="h2o", ratio=0.5, max_new_tokens=4)
    assert a.stats.prefill_s == b.stats.prefill_s
    assert b.answers == direct.answers
    with pytest.raises(InvalidParameterError, match="did not record"):
        kvtrim.Session(llama, tokenizer, CTX, methods=["knorm"]).run("snapkv", ratio=0.5, questions="q")


def test_model_without_attention_interface_is_unsupported(tokenizer, monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(type(model), "_supports_attention_backend", False)
    with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
        kvtrim.generate(model, tokenizer, CTX, "q?", ratio=0.5)


def test_headkv_without_artifact_names_the_calibration_command(tokenizer, monkeypatch, tmp_path):
    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    model = tiny_model("llama")
    before = model.config._attn_implementation
    for method in ("headkv", "critical_headkv"):
        with pytest.raises(kvtrim.MissingArtifactError, match="kvtrim calibrate headkv"):
            kvtrim.generate(model, tokenizer, CTX, "q?", method=method, ratio=0.5)
    assert model.config._attn_implementation == before
