from __future__ import annotations

import pytest

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.metrics import needle_recall
from kvtrim.eval.tasks import generate_task, needle_grid
from kvtrim.eval.tasks.base import TokenCounter
from kvtrim.eval.tasks.needle import NEEDLE

HEAD = "<|im_start|> This is a very long story book: <book> "


@pytest.fixture(scope="module")
def grid(bpe_tokenizer, jargon_text):
    return needle_grid(bpe_tokenizer, [1000, 1600], [0, 10, 33, 50, 77, 100])


def test_grid_shape_and_prompt(grid) -> None:
    assert [(s.meta["context_length"], s.meta["depth_percent"]) for s in grid] == [
        (length, depth) for length in (1000, 1600) for depth in (0, 10, 33, 50, 77, 100)
    ]
    assert [s.index for s in grid] == list(range(12))
    for sample in grid:
        assert sample.context.startswith(HEAD) and sample.context.endswith(" </book>.\n")
        assert sample.question == (
            " Based on the content of the book, Question: The best thing to do in San Francisco is: \nAnswer:"
        )
        assert sample.answers == ["eat a sandwich and sit in Dolores Park on a sunny day."]
        assert sample.metric == "needle_recall" and sample.max_new_tokens == 30
        assert sample.meta["stop_on_newline"] is True and sample.meta["chat_template"] is False
        assert sample.context.count("The best thing to do in San Francisco is eat a sandwich") == 1


def test_context_length_follows_kamradt_buffer(grid, bpe_tokenizer) -> None:
    counter = TokenCounter(bpe_tokenizer)
    needle_tokens = counter.count(NEEDLE)
    for sample in grid:
        length = sample.meta["context_length"]
        assert sample.meta["haystack_tokens"] == length - 200 - needle_tokens
        book = sample.context[len(HEAD) : -len(" </book>.\n")]
        assert abs(counter.count(book) - (length - 200)) <= 3  # decode/re-encode drift only
        assert sample.meta["prompt_tokens"] <= length


def test_needle_lands_at_depth_after_a_sentence(grid, bpe_tokenizer) -> None:
    counter = TokenCounter(bpe_tokenizer)
    for sample in grid:
        depth = sample.meta["depth_percent"]
        book = sample.context[len(HEAD) : -len(" </book>.\n")]
        before, after = book.split(NEEDLE.strip(), 1)
        haystack_tokens = sample.meta["haystack_tokens"]
        target = haystack_tokens if depth == 100 else int(haystack_tokens * depth / 100)
        inserted = sample.meta["insertion_token_index"]
        assert inserted <= target
        assert target - inserted < 150  # walked back at most one (long) sentence
        assert abs(counter.count(before) - inserted) <= 2
        if depth == 0:
            assert before.strip() == ""
        elif depth == 100:
            assert after.strip() == ""
        else:
            assert before.rstrip().endswith(".")  # previous sentence boundary
        measured = 100 * counter.count(before) / max(haystack_tokens, 1)
        assert measured <= depth + 1 and (depth - measured) < 150 / haystack_tokens * 100


def test_generate_task_needle_and_validation(bpe_tokenizer, jargon_text) -> None:
    samples = generate_task("needle", bpe_tokenizer, 1200, 5)
    assert [s.meta["depth_percent"] for s in samples] == [0, 25, 50, 75, 100]
    assert needle_recall(" eat a sandwich and sit in Dolores Park on a sunny day.", samples[0].answers) == 1.0
    with pytest.raises(InvalidParameterError, match="depths"):
        needle_grid(bpe_tokenizer, [1000], [120])
    with pytest.raises(InvalidParameterError, match="no room"):
        needle_grid(bpe_tokenizer, [220], [50])
