from __future__ import annotations

import math
import re

import pytest

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.metrics import METRICS, copy_item_recall, copy_rouge_l, score_sample
from kvtrim.eval.tasks import TASKS, generate_task
from kvtrim.eval.tasks.base import TokenCounter, length_tolerance
from kvtrim.eval.tasks.long_copy import (
    LONG_COPY_ANSWER_PREFIX,
    LONG_COPY_HEADING,
    LONG_COPY_INTRO,
    LONG_COPY_ITEMS,
    LONG_COPY_QUESTION,
    LONG_COPY_WORDS,
)

ITEM = re.compile(r"([a-z]+): ([1-9]\d{3})")


def test_registered() -> None:
    spec = TASKS["long_copy"]
    assert spec.metric == "copy_rouge_l" and spec.options == ("depth",) and not spec.uses_haystack
    assert {"copy_rouge_l", "copy_item_recall"} <= set(METRICS)


@pytest.mark.parametrize("length", [1024, 4096])
def test_format_and_length(bpe_tokenizer, length: int) -> None:
    samples = generate_task("long_copy", bpe_tokenizer, length, 4, seed=0)
    counter = TokenCounter(bpe_tokenizer)
    for sample in samples:
        items = sample.answers
        assert len(items) == LONG_COPY_ITEMS
        assert all(ITEM.fullmatch(item) for item in items)
        words = [ITEM.fullmatch(item).group(1) for item in items]
        codes = [ITEM.fullmatch(item).group(2) for item in items]
        assert len(set(words)) == len(set(codes)) == LONG_COPY_ITEMS
        assert set(words) <= set(LONG_COPY_WORDS)
        reference = sample.meta["reference"]
        assert reference == "\n".join(f"{i}. {item}" for i, item in enumerate(items, start=1))
        # the reference is in the context, word for word
        assert f"{LONG_COPY_HEADING}\n{reference}\nEnd of the list.\n" in sample.context
        assert sample.context.startswith(LONG_COPY_INTRO + "\n")
        assert sample.question == LONG_COPY_QUESTION and sample.answer_prefix == LONG_COPY_ANSWER_PREFIX
        assert sample.metric == "copy_rouge_l" and sample.meta["secondary_metrics"] == ["copy_item_recall"]
        assert sample.meta["chat_template"] is True and sample.meta["haystack"] == "noise"
        # max_new_tokens covers the reference with 30% to spare
        reference_tokens = counter.count(reference)
        assert sample.meta["reference_tokens"] == reference_tokens
        assert sample.max_new_tokens == math.ceil(1.3 * reference_tokens) >= reference_tokens
        prompt_tokens = counter.count(sample.context + sample.question + sample.answer_prefix)
        total = prompt_tokens + sample.max_new_tokens
        assert length - length_tolerance(length) <= total <= length
        assert sample.meta["length"] == total and sample.meta["prompt_tokens"] == prompt_tokens
    assert len({tuple(s.answers) for s in samples}) == 4
    depths = [s.meta["depth_percent"] for s in samples]
    assert len(set(depths)) == 4 and all(0 <= d <= 100 for d in depths)


def test_byte_tokenizer_budget(tokenizer) -> None:
    sample = generate_task("long_copy", tokenizer, 2048, 1, seed=3)[0]
    reference = sample.meta["reference"]
    assert sample.max_new_tokens == math.ceil(1.3 * len(reference.encode()))  # one token per byte
    total = len((sample.context + sample.question + sample.answer_prefix).encode()) + sample.max_new_tokens
    assert 2048 - length_tolerance(2048) <= total <= 2048


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_depth_places_list(bpe_tokenizer, depth: int) -> None:
    sample = generate_task("long_copy", bpe_tokenizer, 2000, 1, seed=5, depth=depth)[0]
    assert sample.meta["garbage_prefix_chars"] == int(sample.meta["garbage_chars"] * depth / 100)
    assert sample.meta["requested_depth"] == depth
    offset = len(LONG_COPY_INTRO) + 1 + sample.meta["garbage_prefix_chars"] + 1  # intro, newline, filler, newline
    assert sample.context.find(LONG_COPY_HEADING) == sample.meta["list_char_offset"] == offset
    assert sample.meta["list_token_offset"] > 0


def test_seeded_and_validated(bpe_tokenizer) -> None:
    a = generate_task("long_copy", bpe_tokenizer, 1200, 3, seed=11)
    assert a == generate_task("long_copy", bpe_tokenizer, 1200, 3, seed=11)
    assert a != generate_task("long_copy", bpe_tokenizer, 1200, 3, seed=12)
    assert generate_task("long_copy", bpe_tokenizer, 1200, 1, seed=11)[0] == a[0]  # independent of num_samples
    with pytest.raises(InvalidParameterError, match="depth"):
        generate_task("long_copy", bpe_tokenizer, 1200, 1, depth=101)
    with pytest.raises(InvalidParameterError, match="length too small"):
        generate_task("long_copy", bpe_tokenizer, 300, 1)


def test_metrics_on_a_sample(bpe_tokenizer) -> None:
    sample = generate_task("long_copy", bpe_tokenizer, 1500, 1, seed=7)[0]
    items, reference = sample.answers, sample.meta["reference"]
    for metric in ("copy_rouge_l", "copy_item_recall"):
        assert score_sample(sample, reference, metric=metric) == 1.0
        assert score_sample(sample, reference + "\n21. extra: 1234\nEnd of the list.", metric=metric) == 1.0
        assert score_sample(sample, "", metric=metric) == 0.0
    half = "\n".join(reference.split("\n")[: LONG_COPY_ITEMS // 2])
    assert copy_rouge_l(half, items) == pytest.approx(0.5)
    assert copy_item_recall(half, items) == pytest.approx(0.5)
    # reversed order: every item is there, but only one survives in the longest common subsequence
    backwards = "\n".join(reversed(reference.split("\n")))
    assert copy_item_recall(backwards, items) == 1.0
    assert copy_rouge_l(backwards, items) < 0.2
    # right words, wrong codes: half of the order-aware score, no item reproduced
    words_only = "\n".join(item.split(":")[0] + ": 0000" for item in items)
    assert copy_rouge_l(words_only, items) == pytest.approx(0.5)
    assert copy_item_recall(words_only, items) == 0.0
