from __future__ import annotations

import re
from collections import Counter

import pytest

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.haystacks import split_sentences
from kvtrim.eval.tasks import RULER_TASKS, TASKS, generate_task, list_tasks
from kvtrim.eval.tasks.base import TokenCounter, length_tolerance
from kvtrim.eval.tasks.ruler import NIAH_CONFIGS, QUESTION_PATTERNS, _zeta

SYNTHETIC = [name for name in RULER_TASKS if not name.startswith("qa_")]
# Tasks whose haystack grows by whole needles (a distractor needle can exceed the tolerance).
UNIT_BOUND = {"niah_multikey_2", "niah_multikey_3"}


def _family(task: str) -> str:
    return task.split("_")[0]


def _prompt(sample) -> str:
    return sample.context + sample.question + sample.answer_prefix


@pytest.fixture(scope="module")
def generated(bpe_tokenizer, jargon_text):
    """Two samples of each synthetic RULER task at 2048 tokens (shared by several tests)."""
    return {name: generate_task(name, bpe_tokenizer, 2048, 2, seed=7) for name in SYNTHETIC}


def test_registry_lists_all_ruler_tasks() -> None:
    assert len(RULER_TASKS) == 13
    assert set(RULER_TASKS) <= set(list_tasks())
    for name in ("passkey", "passkey_64", "needle"):
        assert name in TASKS
    expected = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
    for name in RULER_TASKS:
        spec = TASKS[name]
        assert spec.max_new_tokens == expected[_family(name)]
        assert spec.metric == ("string_match_part" if name.startswith("qa") else "string_match_all")
        assert spec.description


@pytest.mark.parametrize("name", SYNTHETIC)
def test_lengths_within_tolerance(generated, bpe_tokenizer, name: str) -> None:
    counter = TokenCounter(bpe_tokenizer)
    for sample in generated[name]:
        total = counter.count(_prompt(sample)) + sample.max_new_tokens
        assert total == sample.meta["length"]
        assert total <= 2048
        slack = 2048 - total
        if name in UNIT_BOUND:
            # at most one haystack unit (a distractor needle) short
            unit = max(counter.count(line) for line in sample.context.split("\n")[1:-1]) + 2
            assert slack <= max(length_tolerance(2048), unit)
        else:
            assert slack <= length_tolerance(2048), f"{name}: {slack} tokens short"


@pytest.mark.parametrize("name", SYNTHETIC)
def test_split_matches_kvpress_pattern(generated, name: str) -> None:
    pattern = QUESTION_PATTERNS[_family(name)]
    for sample in generated[name]:
        assert pattern.match(sample.question), sample.question[:80]
        assert len(pattern.findall(sample.question)) == 1
        full = _prompt(sample)
        assert full.startswith(sample.full_prompt())
        assert [m.start() for m in pattern.finditer(full)][-1] == len(sample.context)
        assert sample.meta["chat_template"] is True
        assert sample.meta["target_length"] == 2048


def test_same_seed_same_samples_and_prefix_stability(generated, bpe_tokenizer) -> None:
    for name in ("niah_multikey_1", "vt", "cwe", "fwe"):
        again = generate_task(name, bpe_tokenizer, 2048, 2, seed=7)
        assert [s.to_dict() for s in again] == [s.to_dict() for s in generated[name]]
        first_only = generate_task(name, bpe_tokenizer, 2048, 1, seed=7)
        assert first_only[0] == generated[name][0]
        other = generate_task(name, bpe_tokenizer, 2048, 1, seed=8)
        assert other[0].answers != generated[name][0].answers
    samples = generated["niah_single_2"]
    assert samples[0].answers != samples[1].answers


def _needle_values(context: str, type_v: str, key: str) -> list[str]:
    pattern = re.escape(f"One of the special magic {type_v} for {key} is: ") + r"(\S+)\."
    return re.findall(pattern, context)


@pytest.mark.parametrize("name", list(NIAH_CONFIGS))
def test_niah_answers_are_in_context(generated, name: str) -> None:
    cfg = NIAH_CONFIGS[name]
    for sample in generated[name]:
        queries = sample.meta["queries"]
        assert len(queries) == cfg.num_q
        found = [value for key in queries for value in _needle_values(sample.context, cfg.type_v, key)]
        assert sorted(found) == sorted(sample.answers)
        assert len(sample.answers) == cfg.num_q * cfg.num_v
        for key in queries:
            assert key in sample.question and key in sample.answer_prefix
        if cfg.type_v == "numbers":
            assert all(re.fullmatch(r"[1-9]\d{6}", a) for a in sample.answers)
        if cfg.type_v == "uuids":
            uuid4 = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
            assert all(re.fullmatch(uuid4, a) for a in sample.answers)


def test_niah_singular_and_plural_templates(generated) -> None:
    single = generated["niah_single_1"][0]
    key = single.meta["queries"][0]
    assert single.context.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\nThe grass is green."
    )
    assert single.question == f"What is the special magic number for {key} mentioned in the provided text?"
    assert single.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    uuid_single = generated["niah_single_3"][0]
    assert uuid_single.question.startswith("What is the special magic uuid for ")

    multi = generated["niah_multiquery"][0]
    k = multi.meta["queries"]
    query = f"{k[0]}, {k[1]}, {k[2]}, and {k[3]}"
    assert multi.context.startswith("Some special magic numbers are hidden within the following text.")
    assert multi.question == f"What are all the special magic numbers for {query} mentioned in the provided text?"
    assert multi.answer_prefix == f" The special magic numbers for {query} mentioned in the provided text are"
    multivalue = generated["niah_multivalue"][0]
    assert multivalue.question.startswith("What are all the special magic numbers for ")


def test_niah_haystacks(generated) -> None:
    repeat = generated["niah_single_1"][0]
    body = repeat.context.split("\n")[1:-1]
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    assert sum(line != noise for line in body) == 1
    distractors = generated["niah_multikey_2"][0]
    lines = distractors.context.split("\n")[1:-1]
    assert len(lines) > 20 and all(line.startswith("One of the special magic numbers for ") for line in lines)
    keys = [line.split(" for ")[1].split(" is:")[0] for line in lines]
    assert len(set(keys)) == len(keys)  # distractor keys never collide with the real key
    essay = generated["niah_single_2"][0]
    assert essay.meta["haystack"] == "jargon"
    assert essay.meta["sentence_splitter"] == "kvtrim-regex-v1"
    assert "hacker" in essay.context.lower()


def test_niah_needles_land_at_sampled_depths(generated) -> None:
    """RULER puts needle i after int(n_sentences * depth_i / 100) haystack sentences."""
    for name in ("niah_single_2", "niah_multikey_1", "niah_multiquery", "niah_multivalue"):
        for sample in generated[name]:
            body = sample.context.split("\n", 1)[1].rstrip("\n")
            needles = re.findall(r"One of the special magic numbers for \S+ is: \d+\.", body)
            assert len(needles) == len(sample.meta["needle_depths"])

            def strip_needles(text: str, needles: list[str] = needles) -> str:
                for needle in needles:
                    text = text.replace(needle, " ")
                return text

            haystack_sentences = len(split_sentences(strip_needles(body)))
            positions = sorted(len(split_sentences(strip_needles(body[: body.index(n)]))) for n in needles)
            expected = sorted(int(haystack_sentences * d / 100) for d in sample.meta["needle_depths"])
            assert positions == expected, (name, positions, expected)
            measured = sorted(sample.meta["needle_token_depths"])
            for want, got in zip(sorted(sample.meta["needle_depths"]), measured, strict=True):
                assert abs(want - got) <= 15  # token depth follows sentence depth


def test_vt_chain_resolves_to_answers(generated) -> None:
    for sample in generated["vt"]:
        value = sample.meta["query_value"]
        real = sample.context[sample.context.rindex("Memorize and track") :]
        assigned: dict[str, str] = {}
        for target, source in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", real):
            assigned[target] = source
        reached = {name for name, source in assigned.items() if source == value}
        changed = True
        while changed:
            new = {name for name, source in assigned.items() if source.startswith("VAR ") and source[4:] in reached}
            changed = not new <= reached
            reached |= new
        assert reached == set(sample.answers)
        assert all(re.fullmatch(r"[A-Z]{5}", a) for a in sample.answers)
        assert f"assigned the value {value} in the text above." in sample.question
        assert sample.answer_prefix.startswith(" Answer: According to the chain(s) of variable assignment")
        assert "assgined the value" in sample.answer_prefix


def test_vt_one_shot_demo(generated) -> None:
    sample = generated["vt"][0]
    assert sample.context.startswith(
        " Memorize and track the chain(s) of variable assignment hidden in the following text. "
    )
    demo = sample.context[: sample.context.rindex("Memorize and track")]
    assert demo.count("Memorize and track") == 1
    # RULER drops the last word ("above.") of the whitespace-collapsed template before the answer prefix
    assert re.search(
        r"in the text Answer: According to the chain\(s\) of variable assignment in the text above, "
        r"5 variables are assgined the value \d+, they are:  [A-Z]{3}( [A-Z]{3}){4}\n\n\n\n$",
        demo,
    )
    assert 0 < sample.meta["demo_tokens"] <= 500


def test_cwe_answers_are_most_common(generated, bpe_tokenizer) -> None:
    for sample in generated["cwe"]:
        real = sample.context[sample.context.rindex("Memorize the ones that appear most often.\n") :]
        words = re.findall(r"\d+\. (\S+)", real)
        counts = Counter(words)
        assert {w for w, _ in counts.most_common(10)} == set(sample.answers)
        assert min(counts[a] for a in sample.answers) == 6 and max(counts.values()) == 6  # length < 4096
        assert set(counts.values()) == {6, 1}
        demo = sample.context[: sample.context.rindex("Below is a numbered list")]
        assert demo.count(" Answer: The top 10 words that appear most often in the list are:") == 1
        assert re.search(r"are:1\. \S+ 2\. \S+ .* 10\. \S+\n$", demo)
    big = generate_task("cwe", bpe_tokenizer, 5000, 1, seed=1)[0]
    real = big.context[big.context.rindex("Memorize the ones that appear most often.\n") :]
    counts = Counter(re.findall(r"\d+\. (\S+)", real))
    assert set(counts.values()) == {30, 3}
    assert {w for w, c in counts.items() if c == 30} == set(big.answers)


def test_fwe_answers_are_most_frequent_coded_words(generated) -> None:
    assert _zeta(2.0) == pytest.approx(3.141592653589793**2 / 6, rel=1e-12)
    for sample in generated["fwe"]:
        text = sample.context.split("coded words. ", 1)[1]
        counts = Counter(text.split())
        ranked = [w for w, _ in counts.most_common() if w != "..."]
        assert ranked[:3] == sample.answers or set(ranked[:3]) == set(sample.answers)
        assert counts[sample.answers[2]] > counts[ranked[3]]
        assert counts.most_common(1)[0][0] == "..."
        assert all(re.fullmatch(r"[a-z]{6}", w) for w in sample.answers)


def test_essay_tasks_accept_other_haystacks(bpe_tokenizer, tmp_path) -> None:
    noise = generate_task("niah_single_2", bpe_tokenizer, 1024, 1, seed=1, haystack="noise")[0]
    assert noise.meta["haystack"] == "noise" and "The grass is green." in noise.context
    story = tmp_path / "story.txt"
    story.write_text("The cat sat on the mat. It was warm. " * 50, encoding="utf-8")
    custom = generate_task("niah_single_3", bpe_tokenizer, 1024, 1, seed=1, haystack=f"file:{story}")[0]
    assert custom.meta["haystack"] == f"file:{story}" and "The cat sat on the mat." in custom.context
    fixed = generate_task("niah_single_1", bpe_tokenizer, 1024, 1, seed=1, haystack=f"file:{story}")[0]
    assert fixed.meta["haystack"] == "noise"


def test_parameter_errors(bpe_tokenizer) -> None:
    with pytest.raises(InvalidParameterError, match="unknown task"):
        generate_task("niah_single_9", bpe_tokenizer, 1024, 1)
    with pytest.raises(InvalidParameterError, match="does not take option"):
        generate_task("vt", bpe_tokenizer, 1024, 1, depth=50)
    with pytest.raises(InvalidParameterError, match="length too small"):
        generate_task("niah_single_1", bpe_tokenizer, 150, 1)
    with pytest.raises(InvalidParameterError, match="length"):
        generate_task("fwe", bpe_tokenizer, 0, 1)
    assert generate_task("cwe", bpe_tokenizer, 1024, 0) == []
