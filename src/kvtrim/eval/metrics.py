"""Scoring functions for RULER, LongBench v1, passkey, needle and long-copy tasks.

Every function in :data:`METRICS` has the signature ``fn(prediction, answers, **kwargs) -> float`` and
returns a per-sample score in ``[0, 1]`` (not x100). Benchmarks report the mean x100 rounded to two
decimals; :func:`aggregate` does that.

Conventions reproduced from the reference code:

* RULER (``string_match_all`` / ``string_match_part``): the prediction is stripped, control characters
  ``[\\x00-\\x1f]`` become ``\\n`` (kvpress deletes them instead) and it is stripped again; references
  are matched as case-insensitive substrings.
* LongBench (``LongBench/metrics.py`` + ``eval.py``): the score of a sample is the maximum over its
  ground truths; for trec, triviaqa, samsum and lsht the prediction is first cut to its first line after
  stripping leading newlines (pass ``first_line=True`` or use :func:`longbench_score`).
* ``rouge_score`` uses ROUGE-L F1 from the ``rouge-score`` package (``RougeScorer(["rougeL"])``, no
  stemmer). The official LongBench code uses the ``rouge`` package (``Rouge().get_scores(...)["rouge-l"]
  ["f"]``), which splits on whitespace without lower-casing or dropping punctuation and computes a
  summary-level LCS over "."-separated sentences; ``rouge-score`` lower-cases, keeps only ``[a-z0-9]``
  tokens and takes one LCS over the whole text. Scores therefore differ slightly from published
  LongBench numbers (an empty prediction scores 0 in both).
* ``copy_rouge_l`` / ``copy_item_recall`` (``long_copy``) use the same ``rouge-score`` scorer and its
  tokenizer (lower-case ``[a-z0-9]+`` tokens): ROUGE-L *recall* against the items joined in order, and the
  share of items whose tokens occur contiguously in the prediction.
* ``code_sim_score`` uses ``rapidfuzz.fuzz.ratio`` (the Indel similarity, identical to fuzzywuzzy with
  python-Levenshtein installed), rounded to an integer percent like fuzzywuzzy, then /100.
* ``classification_score`` reproduces the reference's removal-while-iterating loop, which can skip the
  element after a removed one.
"""

from __future__ import annotations

import functools
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from typing import Any

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.haystacks import SENTENCE_SPLITTER

__all__ = [
    "FIRST_LINE_DATASETS",
    "LONGBENCH_METRICS",
    "METRICS",
    "aggregate",
    "classification_score",
    "code_sim_score",
    "copy_item_recall",
    "copy_rouge_l",
    "count_score",
    "first_line",
    "longbench_score",
    "metric_versions",
    "needle_recall",
    "needle_rouge1",
    "normalize_answer",
    "passkey_digit_accuracy",
    "passkey_match",
    "postprocess_ruler",
    "qa_f1_score",
    "retrieval_score",
    "rouge_score",
    "score_sample",
    "string_match_all",
    "string_match_part",
]

MetricFn = Callable[..., float]

# ---- RULER ------------------------------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_ruler(prediction: str) -> str:
    """RULER's prediction clean-up: strip, control characters -> ``\\n``, strip."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """Fraction of references found (case-insensitive substring) in the post-processed prediction."""
    if not answers:
        raise InvalidParameterError("answers=[]: string_match_all needs at least one reference.")
    text = postprocess_ruler(prediction).lower()
    return sum(1.0 for ref in answers if ref.lower() in text) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str], **_: Any) -> float:
    """1.0 if any reference occurs (case-insensitive substring) in the post-processed prediction."""
    if not answers:
        raise InvalidParameterError("answers=[]: string_match_part needs at least one reference.")
    text = postprocess_ruler(prediction).lower()
    return 1.0 if any(ref.lower() in text for ref in answers) else 0.0


# ---- LongBench --------------------------------------------------------------------------------------

FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
"""LongBench datasets whose prediction is cut to its first line before scoring."""

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalisation: lower-case, drop punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def first_line(prediction: str) -> str:
    """The first line of ``prediction`` after stripping leading newlines (LongBench few-shot rule)."""
    return prediction.lstrip("\n").split("\n")[0]


def _token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def _qa_f1_one(prediction: str, reference: str) -> float:
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


@functools.lru_cache(maxsize=1)
def _rouge_l_scorer() -> Any:
    try:
        from rouge_score import rouge_scorer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("rouge_score needs the `rouge-score` package: pip install 'kvtrim[eval]'") from exc
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def _rouge_l_one(prediction: str, reference: str) -> float:
    if not prediction.strip() or not reference.strip():
        return 0.0
    return float(_rouge_l_scorer().score(reference, prediction)["rougeL"].fmeasure)


def _classification_one(prediction: str, reference: str, all_classes: Sequence[str]) -> float:
    matches = [name for name in all_classes if name in prediction]
    # The reference removes from `matches` while iterating over it with a for loop: the loop index
    # still advances after a removal, so the element that slid into the current slot is skipped.
    position = 0
    while position < len(matches):
        term = matches[position]
        if term in reference and term != reference:
            matches.remove(term)
        position += 1
    return 1.0 / len(matches) if reference in matches else 0.0


_INTEGER = re.compile(r"\d+")
_PARAGRAPH = re.compile(r"Paragraph (\d+)")


def _fraction_equal(prediction: str, target: str) -> float:
    numbers = _INTEGER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(1 for number in numbers if number == target) / len(numbers)


def _retrieval_one(prediction: str, reference: str) -> float:
    found = _PARAGRAPH.findall(reference)
    if not found:
        raise InvalidParameterError(f"retrieval_score: reference {reference!r} has no 'Paragraph N'.")
    return _fraction_equal(prediction, found[0])


def _count_one(prediction: str, reference: str) -> float:
    return _fraction_equal(prediction, str(reference))


def _code_line(prediction: str) -> str:
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def _code_sim_one(prediction: str, reference: str) -> float:
    try:
        from rapidfuzz import fuzz
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("code_sim_score needs the `rapidfuzz` package: pip install 'kvtrim[eval]'") from exc
    return round(fuzz.ratio(_code_line(prediction), reference)) / 100


def _max_over(one: Callable[[str, str], float], prediction: str, answers: Sequence[str] | str, first: bool) -> float:
    if isinstance(answers, str):
        answers = [answers]
    if not answers:
        raise InvalidParameterError("answers=[]: LongBench metrics need at least one ground truth.")
    if first:
        prediction = first_line(prediction)
    return max(one(prediction, reference) for reference in answers)


def qa_f1_score(prediction: str, answers: Sequence[str] | str, *, first_line: bool = False, **_: Any) -> float:
    """LongBench token F1 after :func:`normalize_answer`, max over ground truths."""
    return _max_over(_qa_f1_one, prediction, answers, first_line)


def rouge_score(prediction: str, answers: Sequence[str] | str, *, first_line: bool = False, **_: Any) -> float:
    """ROUGE-L F1 (``rouge-score`` package, see module notes), max over ground truths; empty -> 0."""
    return _max_over(_rouge_l_one, prediction, answers, first_line)


def classification_score(
    prediction: str,
    answers: Sequence[str] | str,
    *,
    all_classes: Sequence[str] | None = None,
    first_line: bool = False,
    **_: Any,
) -> float:
    """LongBench classification: ``1/len(matches)`` if the ground truth is among the matched class names."""
    if not all_classes:
        raise InvalidParameterError("classification_score needs all_classes=[...] (the dataset's class names).")
    classes = list(all_classes)
    return _max_over(lambda p, r: _classification_one(p, r, classes), prediction, answers, first_line)


def retrieval_score(prediction: str, answers: Sequence[str] | str, *, first_line: bool = False, **_: Any) -> float:
    """LongBench passage retrieval: share of the integers in the prediction equal to the paragraph id."""
    return _max_over(_retrieval_one, prediction, answers, first_line)


def count_score(prediction: str, answers: Sequence[str] | str, *, first_line: bool = False, **_: Any) -> float:
    """LongBench passage count: share of the integers in the prediction equal to the ground truth."""
    return _max_over(_count_one, prediction, answers, first_line)


def code_sim_score(prediction: str, answers: Sequence[str] | str, *, first_line: bool = False, **_: Any) -> float:
    """LongBench code similarity of the first line without a backtick, '#' or '//' (see module notes)."""
    return _max_over(_code_sim_one, prediction, answers, first_line)


LONGBENCH_METRICS: dict[str, str] = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}
"""LongBench's dataset -> metric mapping for the 16 English datasets."""


def longbench_score(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """Score one LongBench prediction exactly as ``eval.py`` does (first-line rule, max over answers)."""
    base = dataset[:-2] if dataset.endswith("_e") else dataset
    if base not in LONGBENCH_METRICS:
        raise InvalidParameterError(f"dataset={dataset!r}: not one of the 16 English LongBench datasets.")
    fn = METRICS[LONGBENCH_METRICS[base]]
    return fn(prediction, answers, all_classes=all_classes, first_line=base in FIRST_LINE_DATASETS)


# ---- passkey and needle -----------------------------------------------------------------------------


def passkey_match(prediction: str, answers: Sequence[str] | str, **_: Any) -> float:
    """1.0 if the first integer (``\\d+``) in the prediction equals the passkey."""
    key = answers if isinstance(answers, str) else answers[0]
    found = _INTEGER.search(prediction)
    return 1.0 if found is not None and found.group(0) == key else 0.0


def passkey_digit_accuracy(prediction: str, answers: Sequence[str] | str, **_: Any) -> float:
    """Fraction of the passkey's digits reproduced at the right position by the first integer.

    The first ``\\d+`` run of the prediction is compared with the key digit by digit from the left;
    missing digits count as wrong and extra digits are ignored.
    """
    key = answers if isinstance(answers, str) else answers[0]
    found = _INTEGER.search(prediction)
    if found is None or not key:
        return 0.0
    guess = found.group(0)
    return sum(1 for a, b in zip(guess, key, strict=False) if a == b) / len(key)


def needle_recall(prediction: str, answers: Sequence[str] | str, **_: Any) -> float:
    """Share of the expected answer's distinct words (lower-cased whitespace split, punctuation kept)
    that appear among the prediction's words (the KV-compression NIAH heat-map score)."""
    expected = answers if isinstance(answers, str) else answers[0]
    expected_words = set(expected.lower().split())
    if not expected_words:
        raise InvalidParameterError("needle_recall: the expected answer is empty.")
    return len(expected_words & set(prediction.lower().split())) / len(expected_words)


@functools.lru_cache(maxsize=1)
def _rouge_1_scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


def needle_rouge1(prediction: str, answers: Sequence[str] | str, *, needle: str | None = None, **_: Any) -> float:
    """ROUGE-1 F (stemmed) of the stripped prediction against the needle (KVCache-Factory's stored score
    is this x10); 0 for an empty prediction. ``needle`` defaults to the expected answer."""
    reference = needle if needle is not None else (answers if isinstance(answers, str) else answers[0])
    prediction = prediction.strip()
    if not prediction:
        return 0.0
    return float(_rouge_1_scorer().score(reference, prediction)["rouge1"].fmeasure)


# ---- long copy --------------------------------------------------------------------------------------


def _copy_items(answers: Sequence[str] | str) -> list[str]:
    items = [answers] if isinstance(answers, str) else list(answers)
    if not items:
        raise InvalidParameterError("answers=[]: the long-copy metrics need the list of items.")
    return items


@functools.lru_cache(maxsize=1)
def _rouge_tokenizer() -> Any:
    try:
        from rouge_score import tokenizers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the long-copy metrics need the `rouge-score` package: pip install 'kvtrim[eval]'") from exc
    return tokenizers.DefaultTokenizer(use_stemmer=False)


def _rouge_tokens(text: str) -> tuple[str, ...]:
    """``rouge-score``'s tokens of ``text`` (lower-cased ``[a-z0-9]+`` runs, no stemming), as ROUGE-L sees them."""
    return tuple(_rouge_tokenizer().tokenize(text))


def copy_rouge_l(prediction: str, answers: Sequence[str] | str, **_: Any) -> float:
    """ROUGE-L recall of the prediction against the items joined in order (``long_copy``); empty -> 0.

    The reference is ``" ".join(answers)``: the share of its tokens that the prediction reproduces as a
    common subsequence, so the score is order-aware and partial. Tokens not in the reference (list numbers,
    chatter, text after the list) are not penalised.
    """
    reference = " ".join(_copy_items(answers))
    if not prediction.strip() or not reference.strip():
        return 0.0
    return float(_rouge_l_scorer().score(reference, prediction)["rougeL"].recall)


def copy_item_recall(prediction: str, answers: Sequence[str] | str, **_: Any) -> float:
    """Fraction of the items reproduced anywhere in the prediction, in any order (``long_copy``).

    An item counts when its ``rouge-score`` tokens (e.g. ``["village", "5104"]`` for ``"village: 5104"``)
    occur as a contiguous run of the prediction's tokens; punctuation and case are ignored.
    """
    items = _copy_items(answers)
    tokens = _rouge_tokens(prediction)
    found = 0
    for item in items:
        wanted = _rouge_tokens(item)
        width = len(wanted)
        if width and any(tokens[i : i + width] == wanted for i in range(len(tokens) - width + 1)):
            found += 1
    return found / len(items)


# ---- registry ---------------------------------------------------------------------------------------

METRICS: dict[str, MetricFn] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1_score": qa_f1_score,
    "rouge_score": rouge_score,
    "classification_score": classification_score,
    "retrieval_score": retrieval_score,
    "count_score": count_score,
    "code_sim_score": code_sim_score,
    "passkey_match": passkey_match,
    "passkey_digit_accuracy": passkey_digit_accuracy,
    "needle_recall": needle_recall,
    "needle_rouge1": needle_rouge1,
    "copy_rouge_l": copy_rouge_l,
    "copy_item_recall": copy_item_recall,
}
"""Metric name -> ``fn(prediction, answers, **kwargs) -> float in [0, 1]``."""


def score_sample(sample: Any, prediction: str, metric: str | None = None) -> float:
    """Score ``prediction`` for a :class:`~kvtrim.eval.tasks.base.Sample` with its metric (or ``metric``).

    Passes the sample's ``meta`` hints: ``all_classes`` (LongBench classification), ``first_line_only``
    (LongBench few-shot datasets) and ``needle`` (needle ROUGE).
    """
    name = metric or sample.metric
    if name not in METRICS:
        raise InvalidParameterError(f"metric={name!r}: unknown; choose one of {sorted(METRICS)}.")
    meta = sample.meta or {}
    kwargs: dict[str, Any] = {}
    if meta.get("all_classes"):
        kwargs["all_classes"] = meta["all_classes"]
    if meta.get("first_line_only"):
        kwargs["first_line"] = True
    if meta.get("needle"):
        kwargs["needle"] = meta["needle"]
    return METRICS[name](prediction, sample.answers, **kwargs)


def aggregate(scores: Iterable[float]) -> float:
    """Benchmark-style summary: mean x100, rounded to two decimals (0.0 for no scores)."""
    values = list(scores)
    if not values:
        return 0.0
    return round(100 * sum(values) / len(values), 2)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def metric_versions() -> dict[str, str | None]:
    """Versions of the scoring dependencies and the choices that affect scores, for results files."""
    return {
        "rouge-score": _version("rouge-score"),
        "rapidfuzz": _version("rapidfuzz"),
        "wonderwords": _version("wonderwords"),
        "rouge_backend": "rouge-score RougeScorer(['rougeL'], use_stemmer=False) (LongBench uses `rouge`)",
        "fuzz_backend": "rapidfuzz.fuzz.ratio rounded to int (= fuzzywuzzy + python-Levenshtein)",
        "sentence_splitter": SENTENCE_SPLITTER,
        "ruler_postprocess": "strip; [\\x00-\\x1f] -> '\\n'; strip",
    }
