"""Prompt layouts: kvtrim's own and kvpress's pipeline layout, token for token."""

from __future__ import annotations

import pytest

import kvtrim
from conftest import byte_tokenizer
from kvtrim.errors import InvalidParameterError
from kvtrim.models import EMBEDDED_MODELS
from kvtrim.prompts import prompt_template
from kvtrim.runtime import tokenize

CONTEXT = "The pass key is 48213. Remember it. The grass is green."
QUESTION = "What is the pass key?"
PREFIX = "Answer: "

# Pinned from kvpress's `kv-press-text-generation` preprocessing (read in NVIDIA/kvpress kvpress/pipeline.py): the
# chat template is rendered with `context + marker` as the user turn and split at the marker; the context part and
# `question + rest + answer_prefix` are tokenized separately without special tokens. Ids for SmolLM2's tokenizer.
KVPRESS_CONTEXT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
    198, 1, 4093, 198, 504, 1301, 1646, 314, 216, 36, 40, 34, 33, 35, 30, 5258, 357, 30, 378, 5372, 314, 2654, 30,
]  # fmt: skip
KVPRESS_QUESTION_IDS = [1780, 314, 260, 1301, 1646, 47, 2, 198, 1, 520, 9531, 198, 21350, 42, 216]

needs_smollm2 = pytest.mark.skipif(
    not (EMBEDDED_MODELS["smollm2-135m"].directory / "tokenizer.json").exists(),
    reason="the embedded SmolLM2 is not provisioned (kvtrim models fetch)",
)


@needs_smollm2
def test_kvpress_layout_token_ids_equal_kvpress_pipeline():
    tok = kvtrim.load_tokenizer("smollm2-135m")
    template = prompt_template(tok, prompt_format="kvpress")
    ctx_ids, _ = tokenize(tok, [template.context_part(CONTEXT)], template.add_special_tokens)
    q_ids, _ = tokenize(tok, [template.question_part(QUESTION, PREFIX)], False)
    assert ctx_ids[0].tolist() == KVPRESS_CONTEXT_IDS
    assert q_ids[0].tolist() == KVPRESS_QUESTION_IDS


@needs_smollm2
def test_kvtrim_layout_differs_by_its_separator():
    tok = kvtrim.load_tokenizer("smollm2-135m")
    template = prompt_template(tok)
    assert template.format == "kvtrim" and template.separator == "\n\n"
    q_ids, _ = tokenize(tok, [template.question_part(QUESTION, PREFIX)], False)
    assert q_ids[0].tolist() != KVPRESS_QUESTION_IDS
    assert q_ids[0].tolist()[-len(KVPRESS_QUESTION_IDS) :] == KVPRESS_QUESTION_IDS  # only "\n\n" in front


def test_kvpress_layout_without_chat_template_matches_kvpress():
    """Without a chat template kvpress puts the BOS text before the context and "\\n" after the question."""
    tok = byte_tokenizer()
    template = prompt_template(tok, prompt_format="kvpress")
    assert template.context_part("ctx") == "<s>ctx"
    assert template.question_part("q?", "A:") == "q?\nA:"
    assert not template.add_special_tokens


def test_separator_overrides_the_format():
    template = prompt_template(byte_tokenizer(), separator=" | ")
    assert template.question_part("q?") == " | q?"


@pytest.mark.parametrize(("kwargs", "match"), [({"prompt_format": "vllm"}, "prompt_format must be one of"),
                                               ({"separator": 3}, "separator must be a string")])  # fmt: skip
def test_bad_layouts_raise(kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        prompt_template(byte_tokenizer(), **kwargs)


def test_results_record_the_layout(llama, tokenizer):
    result = kvtrim.generate(llama, tokenizer, "some context " * 5, "q?", method="full", max_new_tokens=2,
                             prompt_format="kvpress")  # fmt: skip
    assert result.stats.prompt_format == "kvpress" and result.stats.separator == ""
