from __future__ import annotations

import pytest
from rapidfuzz import fuzz

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.metrics import (
    METRICS,
    aggregate,
    classification_score,
    code_sim_score,
    copy_item_recall,
    copy_rouge_l,
    count_score,
    first_line,
    longbench_score,
    metric_versions,
    needle_recall,
    needle_rouge1,
    normalize_answer,
    passkey_digit_accuracy,
    passkey_match,
    postprocess_ruler,
    qa_f1_score,
    retrieval_score,
    rouge_score,
    score_sample,
    string_match_all,
    string_match_part,
)
from kvtrim.eval.tasks.base import Sample


def test_registry_and_range() -> None:
    assert set(METRICS) >= {
        "string_match_all",
        "string_match_part",
        "qa_f1_score",
        "rouge_score",
        "classification_score",
        "retrieval_score",
        "count_score",
        "code_sim_score",
        "passkey_match",
        "passkey_digit_accuracy",
        "needle_recall",
        "copy_rouge_l",
        "copy_item_recall",
    }
    for name, fn in METRICS.items():
        kwargs = {"all_classes": ["x"]} if name == "classification_score" else {}
        answers = ["Paragraph 1"] if name == "retrieval_score" else ["x"]
        assert 0.0 <= fn("", answers, **kwargs) <= 1.0


# ---- RULER -----------------------------------------------------------------------------------------


def test_ruler_postprocess_and_string_match() -> None:
    assert postprocess_ruler("  a\x00b\tc \n") == "a\nb\nc"
    # the control character splits 1234567 (RULER replaces it with a newline; kvpress would delete it)
    assert string_match_all(" 1234\x00567 and 7654321", ["1234567", "7654321"]) == 0.5
    assert string_match_all("The numbers are ABC-def and 42.", ["abc-DEF", "42", "43"]) == pytest.approx(2 / 3)
    assert string_match_part("the answer is Paris", ["London", "paris"]) == 1.0
    assert string_match_part("", ["Paris"]) == 0.0
    assert string_match_all("", ["1", "2"]) == 0.0
    with pytest.raises(InvalidParameterError):
        string_match_all("x", [])


# ---- LongBench --------------------------------------------------------------------------------------


def test_normalize_answer() -> None:
    assert normalize_answer("The  Eiffel-Tower, in an apple!") == "eiffeltower in apple"
    assert normalize_answer("A theater") == "theater"  # whole-word articles only


def test_qa_f1_known_values_and_edge_cases() -> None:
    assert qa_f1_score("The Eiffel Tower, in Paris!", ["Eiffel Tower"]) == pytest.approx(2 / 3)
    assert qa_f1_score("Eiffel Tower", ["the eiffel tower."]) == 1.0
    # max over ground truths
    assert qa_f1_score("Paris", ["London", "Paris, France"]) == pytest.approx(2 / 3)
    assert qa_f1_score("", ["Paris"]) == 0.0
    assert qa_f1_score("the a an", ["Paris"]) == 0.0
    assert qa_f1_score("Paris", "Paris") == 1.0  # a bare string is one ground truth
    # repeated tokens: multiset intersection
    assert qa_f1_score("paris paris", ["paris"]) == pytest.approx(2 * 0.5 * 1 / 1.5)


def test_rouge_l() -> None:
    assert rouge_score("the cat sat on the mat", ["the cat is on the mat"]) == pytest.approx(5 / 6)
    assert rouge_score("", ["a summary"]) == 0.0
    assert rouge_score("   ", ["a summary"]) == 0.0
    assert rouge_score("completely different", ["the cat is on the mat", "completely different"]) == 1.0


def test_classification_reproduces_removal_quirk() -> None:
    classes = ["of", "Description", "Description of something", "Entity"]
    # matches = [of, Description, Description of something]; removing "of" makes the loop skip
    # "Description", which survives, so the score is 1/2 instead of 1
    assert classification_score("Description of something", ["Description of something"], all_classes=classes) == 0.5
    assert classification_score("Entity", ["Entity"], all_classes=classes) == 1.0
    assert classification_score("Entity or Description", ["Entity"], all_classes=classes) == 0.5
    assert classification_score("nothing", ["Entity"], all_classes=classes) == 0.0
    with pytest.raises(InvalidParameterError, match="all_classes"):
        classification_score("Entity", ["Entity"])


def test_retrieval_and_count() -> None:
    assert retrieval_score("Paragraph 3", ["Paragraph 3"]) == 1.0
    assert retrieval_score("Paragraph 3 or Paragraph 13", ["Paragraph 3"]) == 0.5
    assert retrieval_score("I don't know", ["Paragraph 3"]) == 0.0
    assert count_score("There are 7 unique paragraphs, not 8.", ["7"]) == 0.5
    assert count_score("7", ["7"]) == 1.0
    assert count_score("", ["7"]) == 0.0


def test_code_sim_uses_first_code_line() -> None:
    prediction = "\n\n```python\n# set it\nx = foo(1)  \ny = 2\n"
    assert code_sim_score(prediction, ["x = foo(1)  "]) == 1.0
    assert code_sim_score("abce", ["abcd"]) == 0.75
    assert code_sim_score("return a + b", ["return a+b"]) == round(fuzz.ratio("return a + b", "return a+b")) / 100
    assert code_sim_score("// only comments\n# here", ["x"]) == 0.0
    assert code_sim_score("", [""]) == 1.0  # fuzzywuzzy: equal strings score 100


def test_first_line_rule_and_longbench_score() -> None:
    assert first_line("\n\nLocation\nDescription") == "Location"
    classes = ["Location", "Description"]
    assert longbench_score("trec", "\nLocation\nDescription", ["Location"], classes) == 1.0
    assert longbench_score("trec", "Description\nLocation", ["Location"], classes) == 0.0
    # qa datasets without the rule see the whole prediction
    assert longbench_score("hotpotqa", "well\nParis", ["Paris"]) == pytest.approx(2 / 3)
    assert longbench_score("triviaqa", "well\nParis", ["Paris"]) == 0.0
    assert longbench_score("triviaqa_e", "Paris\nwell", ["Paris"]) == 1.0
    with pytest.raises(InvalidParameterError):
        longbench_score("dureader", "x", ["x"])


def test_passkey_metrics() -> None:
    assert passkey_match("The pass key is 12345. Remember it.", ["12345"]) == 1.0
    assert passkey_match(" 123456", ["12345"]) == 0.0
    assert passkey_match("It is 7, no 12345", ["12345"]) == 0.0  # first integer only
    assert passkey_match("no digits", ["12345"]) == 0.0
    assert passkey_digit_accuracy("12045", ["12345"]) == 0.8
    assert passkey_digit_accuracy("123", ["12345"]) == 0.6
    assert passkey_digit_accuracy("1234567", ["12345"]) == 1.0
    assert passkey_digit_accuracy("", ["12345"]) == 0.0


def test_needle_scores() -> None:
    expected = ["eat a sandwich and sit in Dolores Park on a sunny day."]
    assert needle_recall("Eat a sandwich and sit in Dolores Park on a sunny day.", expected) == 1.0
    assert needle_recall("eat a sandwich and sit in dolores park on a sunny day", expected) == pytest.approx(10 / 11)
    assert needle_recall("", expected) == 0.0
    assert needle_rouge1("", expected) == 0.0
    assert needle_rouge1("eat a sandwich and sit in Dolores Park on a sunny day.", expected) == 1.0


def test_long_copy_scores() -> None:
    items = ["apple: 1234", "river: 5678", "candle: 9012", "pencil: 3456"]
    reference = "1. apple: 1234\n2. river: 5678\n3. candle: 9012\n4. pencil: 3456"
    for fn in (copy_rouge_l, copy_item_recall):
        assert fn(reference, items) == 1.0
        assert fn("Sure! APPLE 1234, river - 5678; candle: 9012 and pencil: 3456. Done.", items) == 1.0
        assert fn("", items) == 0.0
        assert fn("nothing relevant", items) == 0.0
    # truncated: order-aware and order-free scores agree
    assert copy_rouge_l("1. apple: 1234\n2. river: 5678", items) == 0.5
    assert copy_item_recall("1. apple: 1234\n2. river: 5678", items) == 0.5
    # swapped pairs: all items present, order partly lost (LCS keeps 2 of the 4 items = 4 of 8 tokens)
    swapped = "river: 5678\napple: 1234\npencil: 3456\ncandle: 9012"
    assert copy_item_recall(swapped, items) == 1.0
    assert copy_rouge_l(swapped, items) == 0.5
    # a word with the wrong code counts for ROUGE-L only; an item must be word then code, adjacent
    assert copy_rouge_l("apple: 1111", items) == 1 / 8
    assert copy_item_recall("apple: 1111", items) == 0.0
    assert copy_item_recall("apple river 1234 5678", items) == 0.0
    assert copy_rouge_l("apple river 1234 5678", items) == 3 / 8  # LCS: apple, river, 5678
    assert copy_item_recall("apple: 1234", "apple: 1234") == 1.0  # a bare string is one item
    with pytest.raises(InvalidParameterError, match="answers"):
        copy_rouge_l("x", [])


def test_score_sample_uses_meta() -> None:
    sample = Sample(
        task="trec",
        context="",
        question="",
        answer_prefix="Type:",
        answers=["Location"],
        metric="classification_score",
        max_new_tokens=64,
        index=0,
        seed=0,
        meta={"all_classes": ["Location", "Description"], "first_line_only": True},
    )
    assert score_sample(sample, " Location\nDescription") == 1.0
    assert score_sample(sample, "Location", metric="qa_f1_score") == 1.0
    with pytest.raises(InvalidParameterError, match="metric"):
        score_sample(sample, "x", metric="bleu")


def test_aggregate_and_versions() -> None:
    assert aggregate([1.0, 0.5, 0.0]) == 50.0
    assert aggregate([1 / 3]) == 33.33
    assert aggregate([]) == 0.0
    versions = metric_versions()
    assert versions["rouge-score"] == "0.1.2"
    assert versions["rapidfuzz"] and versions["wonderwords"]
    assert versions["sentence_splitter"] == "kvtrim-regex-v1"
