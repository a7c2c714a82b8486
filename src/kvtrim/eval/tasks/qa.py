"""RULER ``qa_1`` (SQuAD v2.0 dev) and ``qa_2`` (HotpotQA dev-distractor), from user-supplied JSON files.

The data cannot be downloaded by kvtrim; pass the official files:
``generate_task("qa_1", tok, 4096, 10, squad_path="dev-v2.0.json")`` and
``generate_task("qa_2", tok, 4096, 10, hotpotqa_path="hotpot_dev_distractor_v1.json")``.

As in RULER, sample ``i`` asks question ``i`` of the file (answerable SQuAD questions in file order),
its gold document(s) come first, then (SQuAD) other paragraphs of the same article, then random other
documents; the list is shuffled with ``random.Random(seed)`` (so, as in RULER, the permutation depends
only on the number of documents) and rendered as ``Document {i}:\\n{text}`` joined by blank lines. The
number of documents is fitted to the target length.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.tasks.base import BuiltPrompt, Sample, check_common_args, sample_rng, split_at_last
from kvtrim.eval.tasks.ruler import QUESTION_PATTERNS, ruler_samples

__all__ = ["QA_ANSWER_PREFIX", "QA_TEMPLATE", "generate_qa", "read_hotpotqa", "read_squad"]

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
_DOCUMENT = "Document {i}:\n{document}"


@dataclass(frozen=True)
class _QA:
    query: str
    answers: list[str]
    gold: list[int]
    more: list[int]


def _load_json(path: str | Path, parameter: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{parameter}={str(path)!r}: file not found.")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise InvalidParameterError(f"{parameter}={str(path)!r}: not valid JSON ({exc}).") from exc


@functools.lru_cache(maxsize=4)
def read_squad(path: str) -> tuple[list[_QA], list[str]]:
    """Answerable questions and the sorted, deduplicated paragraphs of a SQuAD v2.0 JSON file."""
    data = _load_json(path, "squad_path")
    try:
        articles = data["data"]
        docs = sorted({p["context"] for a in articles for p in a["paragraphs"]})
        doc_id = {doc: i for i, doc in enumerate(docs)}
        qas: list[_QA] = []
        for article in articles:
            article_docs = [doc_id[p["context"]] for p in article["paragraphs"]]
            for paragraph in article["paragraphs"]:
                gold = doc_id[paragraph["context"]]
                for qa in paragraph["qas"]:
                    if qa.get("is_impossible", False):
                        continue
                    qas.append(
                        _QA(
                            query=qa["question"],
                            answers=[a["text"] for a in qa["answers"]],
                            gold=[gold],
                            more=[d for d in article_docs if d != gold],
                        )
                    )
    except (KeyError, TypeError) as exc:
        raise InvalidParameterError(f"squad_path={path!r}: not in SQuAD v2.0 format (missing {exc}).") from exc
    return qas, docs


@functools.lru_cache(maxsize=4)
def read_hotpotqa(path: str) -> tuple[list[_QA], list[str]]:
    """Questions and the sorted, deduplicated ``title\\n`` + sentences documents of a HotpotQA JSON file."""
    data = _load_json(path, "hotpotqa_path")
    try:
        docs = sorted({f"{title}\n{''.join(sentences)}" for row in data for title, sentences in row["context"]})
        doc_id = {doc: i for i, doc in enumerate(docs)}
        qas = [
            _QA(
                query=row["question"],
                answers=[row["answer"]],
                gold=[doc_id[f"{title}\n{''.join(sentences)}"] for title, sentences in row["context"]],
                more=[],
            )
            for row in data
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidParameterError(f"hotpotqa_path={path!r}: not in HotpotQA format ({exc}).") from exc
    return qas, docs


def _pick_documents(qa: _QA, docs: list[str], n: int, rng: random.Random) -> list[int]:
    if n >= len(docs):
        return (list(range(len(docs))) * (n // len(docs) + 1))[:n]
    gold = qa.gold[:n] if n < len(qa.gold) else qa.gold
    if n - len(gold) > len(qa.more):
        used = set(gold) | set(qa.more)
        others = [i for i in range(len(docs)) if i not in used]
        return gold + qa.more + rng.sample(others, max(0, n - len(gold) - len(qa.more)))
    return gold + rng.sample(qa.more, n - len(gold))


def generate_qa(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
    squad_path: str | Path | None = None,
    hotpotqa_path: str | Path | None = None,
) -> list[Sample]:
    """Generate RULER ``qa_1`` (needs ``squad_path``) or ``qa_2`` (needs ``hotpotqa_path``)."""
    check_common_args(task, length, num_samples, seed)
    if task == "qa_1":
        if squad_path is None:
            raise InvalidParameterError(
                "qa_1 needs squad_path=<path to SQuAD v2.0 dev JSON (dev-v2.0.json)>; kvtrim cannot download it."
            )
        qas, docs = read_squad(str(Path(squad_path).expanduser().resolve()))
        source = "squad"
    elif task == "qa_2":
        if hotpotqa_path is None:
            raise InvalidParameterError(
                "qa_2 needs hotpotqa_path=<path to HotpotQA dev-distractor JSON "
                "(hotpot_dev_distractor_v1.json)>; kvtrim cannot download it."
            )
        qas, docs = read_hotpotqa(str(Path(hotpotqa_path).expanduser().resolve()))
        source = "hotpotqa"
    else:
        raise InvalidParameterError(f"task={task!r}: expected 'qa_1' or 'qa_2'.")
    if not qas or not docs:
        raise InvalidParameterError(f"{source} file contains no usable questions.")
    if num_samples > len(qas):
        raise InvalidParameterError(
            f"num_samples={num_samples}: the {source} file has only {len(qas)} usable questions."
        )

    def build(index: int, n: int) -> BuiltPrompt:
        qa = qas[index]
        chosen = _pick_documents(qa, docs, n, sample_rng(task, seed, index))
        random.Random(seed).shuffle(chosen)
        body = "\n\n".join(_DOCUMENT.format(i=i + 1, document=docs[d]) for i, d in enumerate(chosen))
        prompt = QA_TEMPLATE.format(context=body, query=qa.query)
        context, question = split_at_last(prompt, QUESTION_PATTERNS["qa"])
        gold = set(qa.gold)
        meta = {
            "num_docs": n,
            "question_index": index,
            "gold_document_numbers": [i + 1 for i, d in enumerate(chosen) if d in gold],
        }
        return BuiltPrompt(context, question, QA_ANSWER_PREFIX, list(qa.answers), meta)

    return ruler_samples("qa", task, tokenizer, length, num_samples, seed, build, metric="string_match_part", low=1,
                         high=max(len(docs) * 64, 1), unit="documents", haystack=source)  # fmt: skip
