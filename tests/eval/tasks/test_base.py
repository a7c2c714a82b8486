from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.tasks.base import Sample, TokenCounter, fit_units, length_tolerance, sample_rng, split_at_last


def _sample() -> Sample:
    return Sample(
        task="t",
        context="long context ",
        question="question?",
        answer_prefix=" Answer:",
        answers=["a", "b"],
        metric="string_match_all",
        max_new_tokens=8,
        index=3,
        seed=42,
        meta={"depth": 50},
    )


def test_sample_roundtrip_and_full_prompt() -> None:
    sample = _sample()
    assert sample.full_prompt() == "long context question?"
    data = json.loads(json.dumps(sample.to_dict()))
    assert Sample.from_dict(data) == sample
    with pytest.raises(AttributeError):
        sample.context = "x"  # type: ignore[misc]


def test_length_tolerance() -> None:
    assert length_tolerance(1000) == 30
    assert length_tolerance(4096) == 81
    assert length_tolerance(131072) == 2621


def test_sample_rng_depends_on_all_parts() -> None:
    keys = [("a", 1, 0), ("a", 1, 1), ("a", 2, 0), ("b", 1, 0)]
    draws = {tuple(sample_rng(*key).random() for _ in range(2)) for key in keys}
    assert len(draws) == 4
    assert sample_rng("a", 1, 0).random() == sample_rng("a", 1, 0).random()


def test_split_at_last_uses_last_match() -> None:
    pattern = re.compile(r"Question:")
    assert split_at_last("demo Question: x ctx Question: y", pattern) == ("demo Question: x ctx ", "Question: y")
    with pytest.raises(ValueError):
        split_at_last("nothing here", pattern)


@settings(max_examples=80, deadline=None)
@given(
    overhead=st.integers(0, 500),
    per_unit=st.integers(1, 40),
    budget=st.integers(1, 20_000),
    hint=st.one_of(st.none(), st.integers(0, 5000)),
)
def test_fit_units_finds_largest_fitting_count(overhead: int, per_unit: int, budget: int, hint: int | None) -> None:
    calls: list[int] = []

    def build(n: int) -> int:
        calls.append(n)
        return n

    def count(n: int) -> int:
        return overhead + per_unit * n

    if overhead + per_unit > budget:
        with pytest.raises(InvalidParameterError, match="length too small"):
            fit_units(build, count, budget, 1, 10**6, hint)
        return
    result = fit_units(build, count, budget, 1, 10**6, hint)
    assert result.tokens <= budget
    assert count(result.units + 1) > budget  # largest
    assert result.units == (budget - overhead) // per_unit
    assert len(calls) <= 40


def test_fit_units_respects_high_and_tolerates_wobble() -> None:
    result = fit_units(lambda n: n, lambda n: 10 * n, 10**6, 1, 50)
    assert result.units == 50
    # token counts that wobble by a few tokens (needle positions move with n) still give a fitting n
    wobble = fit_units(lambda n: n, lambda n: 7 * n + (n * 7919) % 5, 3000, 1, 10**5, hint=10)
    assert 7 * wobble.units + (wobble.units * 7919) % 5 <= 3000
    assert wobble.units >= (3000 - 4) // 7 - 1


def test_token_counter_matches_tokenizer(bpe_tokenizer) -> None:
    counter = TokenCounter(bpe_tokenizer)
    text = "The grass is green. The sky is blue."
    assert counter.encode(text) == bpe_tokenizer.encode(text, add_special_tokens=False)
    assert counter.count(text) == len(bpe_tokenizer.encode(text, add_special_tokens=False))
    positions = counter.char_to_token(text, [0, text.index("sky")])
    assert positions is not None and positions[0] == 0
    assert counter.decode(counter.encode(text)[positions[1] :]).strip().startswith("sky")
    with pytest.raises(InvalidParameterError):
        TokenCounter(None)
