"""The transformers pipeline task "kvtrim-text-generation"."""

from __future__ import annotations

import pytest
from transformers import pipeline

import kvtrim
import kvtrim.hf_pipeline  # registers the task
from conftest import random_text
from kvtrim.errors import InvalidParameterError

CTX = random_text(120, seed=21)


@pytest.fixture
def pipe(llama, tokenizer):
    return pipeline("kvtrim-text-generation", model=llama, tokenizer=tokenizer)


def test_one_question_matches_kvtrim_generate(pipe, llama, tokenizer):
    out = pipe(CTX, question="What is it?", method="snapkv", ratio=0.5, max_new_tokens=8)
    expected = kvtrim.generate(llama, tokenizer, CTX, "What is it?", method="snapkv", ratio=0.5, max_new_tokens=8,
                               prompt_format="kvpress")  # fmt: skip
    assert out == {"answer": expected.answers[0]}


def test_batched_questions_share_one_compressed_context(pipe, llama, tokenizer):
    questions = ["What is it?", "Where is it?", "Who?"]
    out = pipe(CTX, questions=questions, method="tova", budget=40, answer_prefix="A:", max_new_tokens=6,
               return_stats=True)  # fmt: skip
    assert len(out["answers"]) == 3
    assert out["stats"]["kv_entries_after"] < out["stats"]["kv_entries_before"]
    assert out["stats"]["prompt_format"] == "kvpress"
    singles = [pipe(CTX, question=q, method="tova", budget=40, answer_prefix="A:", max_new_tokens=6)["answer"]
               for q in questions]  # fmt: skip
    assert out["answers"] == singles


def test_question_aware_and_full(pipe, llama, tokenizer):
    qa = pipe(CTX, question="What is it?", method="snapkv", ratio=0.5, question_aware=True, max_new_tokens=6,
              return_stats=True)  # fmt: skip
    assert qa["stats"]["question_aware"] is True
    full = pipe(CTX, question="What is it?", method="full", max_new_tokens=6, return_stats=True)
    assert full["stats"]["kv_entries_after"] == full["stats"]["kv_entries_before"]


def test_bad_arguments_raise(pipe):
    with pytest.raises(InvalidParameterError, match="instead of press="):
        pipe(CTX, question="q", press=object())
    with pytest.raises(InvalidParameterError, match="unknown argument"):
        pipe(CTX, question="q", ratio=0.5, compression_ratio=0.5)
    with pytest.raises(InvalidParameterError, match=r"ratio must be in \[0, 1\)"):
        pipe(CTX, question="q", ratio=1.5)
    with pytest.raises(InvalidParameterError, match="question or questions"):
        pipe(CTX, question="q", questions=["a"], ratio=0.5)
