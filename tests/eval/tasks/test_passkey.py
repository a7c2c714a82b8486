from __future__ import annotations

import re

import pytest

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.metrics import passkey_digit_accuracy, passkey_match
from kvtrim.eval.tasks import generate_task
from kvtrim.eval.tasks.base import TokenCounter, length_tolerance
from kvtrim.eval.tasks.passkey import PASSKEY_ANSWER_PREFIX, PASSKEY_INTRO, PASSKEY_QUESTION

GARBAGE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def _lines(sample) -> list[str]:
    return (sample.context + sample.question + sample.answer_prefix).split("\n")


def test_landmark_format(bpe_tokenizer) -> None:
    samples = generate_task("passkey", bpe_tokenizer, 1500, 5, seed=0)
    counter = TokenCounter(bpe_tokenizer)
    for sample in samples:
        lines = _lines(sample)
        key = sample.answers[0]
        assert len(lines) == 5
        assert (
            lines[0]
            == PASSKEY_INTRO
            == (
                "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                "I will quiz you about the important information there."
            )
        )
        assert lines[2] == f"The pass key is {key}. Remember it. {key} is the pass key."
        assert lines[4] == PASSKEY_QUESTION + PASSKEY_ANSWER_PREFIX == "What is the pass key? The pass key is"
        infinite = " ".join([GARBAGE] * 100)
        assert infinite.startswith(lines[1]) and infinite.startswith(lines[3])  # both sliced from the start
        assert len(lines[1]) + len(lines[3]) == sample.meta["garbage_chars"]
        assert 1 <= int(key) <= 50000
        assert sample.answer_prefix == " The pass key is" and sample.max_new_tokens == 10
        assert sample.meta["chat_template"] is False
        total = counter.count(sample.context + sample.question + sample.answer_prefix) + 10
        assert 1500 - length_tolerance(1500) <= total <= 1500
    depths = [s.meta["depth_percent"] for s in samples]
    assert len(set(depths)) == 5 and all(0 <= d <= 100 for d in depths)


@pytest.mark.parametrize("depth", [0, 25, 50, 100])
def test_depth_places_key(bpe_tokenizer, depth: int) -> None:
    sample = generate_task("passkey", bpe_tokenizer, 2000, 1, seed=5, depth=depth)[0]
    lines = _lines(sample)
    assert len(lines[1]) == int(sample.meta["garbage_chars"] * depth / 100)
    relative = sample.meta["key_char_offset"] / len(sample.context)
    assert abs(relative - depth / 100) < 0.05
    assert sample.meta["requested_depth"] == depth


def test_passkey_64(bpe_tokenizer) -> None:
    samples = generate_task("passkey_64", bpe_tokenizer, 1200, 3, seed=2)
    for sample in samples:
        key = sample.answers[0]
        assert re.fullmatch(r"[1-9]\d{63}", key)
        assert f"The pass key is {key}. Remember it. {key} is the pass key." in sample.context
        assert sample.max_new_tokens == 72
        assert sample.meta["secondary_metrics"] == ["passkey_digit_accuracy"]
        assert passkey_match(f" {key}. Remember it.", sample.answers) == 1.0
        wrong = key[:32] + ("0" if key[32] != "0" else "1") + key[33:]
        assert passkey_match(wrong, sample.answers) == 0.0
        assert passkey_digit_accuracy(wrong, sample.answers) == pytest.approx(63 / 64)
    assert len({s.answers[0] for s in samples}) == 3


def test_passkey_seeded_and_validated(bpe_tokenizer) -> None:
    a = generate_task("passkey", bpe_tokenizer, 1000, 3, seed=11)
    assert a == generate_task("passkey", bpe_tokenizer, 1000, 3, seed=11)
    assert a != generate_task("passkey", bpe_tokenizer, 1000, 3, seed=12)
    with pytest.raises(InvalidParameterError, match="depth"):
        generate_task("passkey", bpe_tokenizer, 1000, 1, depth=150)
    with pytest.raises(InvalidParameterError, match="length too small"):
        generate_task("passkey", bpe_tokenizer, 40, 1)
