"""LongBench v1 (the 16 English datasets): loader, official prompts, truncation and context/question split.

The data cannot be downloaded by kvtrim. Put the official files (``data.zip`` from the
``THUDM/LongBench`` Hugging Face dataset repository, unzipped) in one directory::

    <data_dir>/narrativeqa.jsonl
    <data_dir>/qasper.jsonl
    ...                           (one {name}.jsonl per dataset; {name}_e.jsonl for LongBench-E)

Each line has ``input``, ``context``, ``answers``, ``length``, ``dataset``, ``language``,
``all_classes`` and ``_id``.

Protocol (official ``pred.py``): ``prompt = DATASET2PROMPT[name].format(**row)``; if the tokenized prompt
exceeds ``max_length`` tokens it is truncated in the middle (first half + last half of the tokens,
decoded with special tokens skipped, see :func:`truncate_middle`); the chat template is applied except
for :data:`NO_CHAT_TEMPLATE` (``meta["chat_template"]``); greedy decoding with
``max_new_tokens = DATASET2MAXLEN[name]``; samsum also stops at a newline and must generate at least one
token (``meta["stop_on_newline"]``, ``meta["min_new_tokens"]``).

Context-only split (kvpress style, our own table :data:`PROMPT_SPLITS`): ``context`` is the template up
to and including the document and any instruction that does not depend on the row's ``input``;
``question`` is the part that carries ``input`` (for datasets without an ``input`` field it is only the
separator text before the answer cue); ``answer_prefix`` is the final cue (``Answer:``, ``Summary:``,
``The answer is: ``, ``Next line of code:\\n``, ...). For the few-shot datasets (trec, triviaqa, samsum)
the cue ending ``input`` (``Type:``, ``Answer:``, ``Summary:``) becomes the answer prefix. In every case
``context + question + answer_prefix`` equals the official prompt exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.metrics import FIRST_LINE_DATASETS, LONGBENCH_METRICS
from kvtrim.eval.tasks.base import Sample

__all__ = [
    "DATASET2MAXLEN",
    "DATASET2PROMPT",
    "LONGBENCH_DATASETS",
    "LONGBENCH_E_DATASETS",
    "NO_CHAT_TEMPLATE",
    "PROMPT_SPLITS",
    "PromptSplit",
    "load_longbench",
    "split_prompt",
    "truncate_middle",
]

LONGBENCH_DATASETS: tuple[str, ...] = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
"""The 16 English LongBench v1 datasets."""

LONGBENCH_E_DATASETS: tuple[str, ...] = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
"""English datasets that have a LongBench-E (``{name}_e``) version."""

# Official LongBench/config/dataset2prompt.json strings (typos included).
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation."
        "\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a "
        "single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, "
        "using a single phrase or sentence if possible. If the question cannot be answered based on the "
        'information in the article, write "unanswerable". If the question is a yes/no question, answer '
        '"yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the '
        "question based on the above article as concisely as you can, using a single phrase or sentence if "
        "possible. If the question cannot be answered based on the information in the article, write "
        '"unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not '
        "provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based "
        "on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
        "Answer:"
    ),
    "hotpotqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
        "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "2wikimqa": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
        "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "musique": (
        "Answer the question based on the given passages. Only give me the answer and do not output any other "
        "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
        "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query "
        "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above "
        "meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format should "
        "only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number "
        'of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph '
        '2", etc.\n\nThe answer is: '
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# Official LongBench/config/dataset2maxlen.json (English datasets).
DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
    "passage_count": 32,
    "passage_retrieval_en": 32,
    "lcc": 64,
    "repobench-p": 64,
}

NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
"""Datasets the official ``pred.py`` runs without the chat template."""


@dataclass(frozen=True)
class PromptSplit:
    """How one dataset's prompt is cut: ``context`` / ``question`` / ``answer_prefix`` templates.

    ``input_cue``: for few-shot datasets, the cue that ends ``input`` and moves to the answer prefix.
    """

    context: str
    question: str
    answer_prefix: str
    input_cue: str | None = None


def _split_from_official(name: str, question_start: str, answer_prefix: str) -> PromptSplit:
    template = DATASET2PROMPT[name]
    q_start = template.rindex(question_start)
    a_start = template.rindex(answer_prefix)
    return PromptSplit(template[:q_start], template[q_start:a_start], answer_prefix)


PROMPT_SPLITS: dict[str, PromptSplit] = {
    # question starts at the separator before "Question:" / "Query:" / the abstract / the input code
    "narrativeqa": _split_from_official("narrativeqa", "\n\nQuestion: {input}", "Answer:"),
    "qasper": _split_from_official("qasper", "\n\nQuestion: {input}", "Answer:"),
    "multifieldqa_en": _split_from_official("multifieldqa_en", "\n\nQuestion: {input}", "Answer:"),
    "hotpotqa": _split_from_official("hotpotqa", "\n\nQuestion: {input}", "Answer:"),
    "2wikimqa": _split_from_official("2wikimqa", "\n\nQuestion: {input}", "Answer:"),
    "musique": _split_from_official("musique", "\n\nQuestion: {input}", "Answer:"),
    "gov_report": _split_from_official("gov_report", "\n\nSummary:", "Summary:"),
    "qmsum": _split_from_official("qmsum", "\n\nQuery: {input}", "Answer:"),
    "multi_news": _split_from_official("multi_news", "\n\nSummary:", "Summary:"),
    "trec": PromptSplit(DATASET2PROMPT["trec"][: -len("\n{input}")], "\n{input}", "", "Type:"),
    "triviaqa": PromptSplit(DATASET2PROMPT["triviaqa"][: -len("\n\n{input}")], "\n\n{input}", "", "Answer:"),
    "samsum": PromptSplit(DATASET2PROMPT["samsum"][: -len("\n\n{input}")], "\n\n{input}", "", "Summary:"),
    "passage_count": _split_from_official("passage_count", "\n\nThe final answer is: ", "The final answer is: "),
    "passage_retrieval_en": _split_from_official(
        "passage_retrieval_en", "\n\n{input}\n\nPlease enter", "The answer is: "
    ),
    "lcc": PromptSplit("Please complete the code given below. \n{context}", "", "Next line of code:\n"),
    "repobench-p": PromptSplit("Please complete the code given below. \n{context}", "{input}", "Next line of code:\n"),
}
"""Per-dataset context/question/answer-prefix templates (see the module docstring)."""


_FIELD = re.compile(r"\{(context|input)\}")


def _format(template: str, row: dict[str, Any]) -> str:
    """``template.format(**row)`` for our two fields, in one pass (row text is never re-scanned)."""
    return _FIELD.sub(lambda m: str(row.get(m.group(1)) or ""), template)


def split_prompt(name: str, row: dict[str, Any]) -> tuple[str, str, str]:
    """``(context, question, answer_prefix)`` for a LongBench row; their concatenation is the official prompt."""
    base = _base_name(name)
    split = PROMPT_SPLITS[base]
    context = _format(split.context, row)
    question = _format(split.question, row)
    answer_prefix = split.answer_prefix
    if split.input_cue is not None:
        stripped = question.rstrip()
        if stripped.endswith(split.input_cue):
            cut = stripped.rindex(split.input_cue)
            question, answer_prefix = question[:cut], question[cut:]
    return context, question, answer_prefix


def _base_name(name: str) -> str:
    base = name[:-2] if name.endswith("_e") else name
    if base not in DATASET2PROMPT:
        raise InvalidParameterError(
            f"name={name!r}: not one of the 16 English LongBench datasets {list(LONGBENCH_DATASETS)} "
            "(append '_e' for LongBench-E)."
        )
    if name.endswith("_e") and base not in LONGBENCH_E_DATASETS:
        raise InvalidParameterError(f"name={name!r}: {base} has no LongBench-E version.")
    return base


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    # The official code counts tokenizer(prompt).input_ids, i.e. with the tokenizer's special tokens.
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def truncate_middle(text: str, tokenizer: Any, max_length: int) -> str:
    """LongBench's middle truncation: if ``text`` has more than ``max_length`` tokens (special tokens
    included, as ``tokenizer(prompt)`` counts them), keep the decoded first ``int(max_length / 2)`` and
    last ``int(max_length / 2)`` tokens (special tokens skipped); otherwise return ``text`` unchanged."""
    if max_length <= 1:
        raise InvalidParameterError(f"max_length={max_length!r}: expected at least 2 tokens.")
    ids = _token_ids(tokenizer, text)
    if len(ids) <= max_length:
        return text
    half = int(max_length / 2)
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise InvalidParameterError(f"{path}:{number}: not valid JSON ({exc}).") from exc
    return rows


def load_longbench(
    name: str,
    data_dir: str | Path,
    tokenizer: Any | None = None,
    max_length: int | None = None,
    limit: int | None = None,
) -> list[Sample]:
    """Load LongBench dataset ``name`` (or ``{name}_e``) from ``{data_dir}/{name}.jsonl`` as samples.

    With ``max_length`` (tokens, e.g. 3500, 7500 or 31500) prompts longer than that are truncated in the
    middle like the official ``pred.py`` (needs ``tokenizer``); the truncated prompt is then re-split
    (``meta["truncated"]``; ``meta["truncation"]`` is ``"middle"`` normally, ``"context-middle"`` when the
    question itself would have been cut, see :func:`_truncate_split`). ``limit`` keeps the first rows only.
    """
    base = _base_name(name)
    if max_length is not None and tokenizer is None:
        raise InvalidParameterError("max_length is set but tokenizer=None: truncation needs the tokenizer.")
    directory = Path(data_dir).expanduser()
    path = directory / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"data_dir={str(data_dir)!r}: {path} not found. kvtrim cannot download LongBench here; get "
            "data.zip from the THUDM/LongBench dataset repository on Hugging Face, unzip it and pass the folder "
            f"that holds the files, laid out as {directory}/<dataset>.jsonl (e.g. {directory}/narrativeqa.jsonl, "
            f"{directory}/qasper.jsonl, ..., {directory}/qasper_e.jsonl for LongBench-E)."
        )
    rows = _read_rows(path)
    if limit is not None:
        rows = rows[: max(limit, 0)]
    samples: list[Sample] = []
    for index, row in enumerate(rows):
        if "answers" not in row:
            raise InvalidParameterError(f"{path}: row {index} has no 'answers' field.")
        context, question, answer_prefix = split_prompt(name, row)
        meta: dict[str, Any] = {
            "benchmark": "longbench",
            "dataset": base,
            "longbench_e": name.endswith("_e"),
            "_id": row.get("_id"),
            "longbench_length": row.get("length"),  # the row's `length`: words (English), for LongBench-E buckets
            "all_classes": row.get("all_classes"),
            "chat_template": base not in NO_CHAT_TEMPLATE,
            "first_line_only": base in FIRST_LINE_DATASETS,
            "stop_on_newline": base == "samsum",
            "min_new_tokens": 1 if base == "samsum" else 0,
            "truncated": False,
            "truncation": "none",
        }
        if tokenizer is not None:
            prompt = context + question + answer_prefix
            meta["prompt_tokens"] = len(_token_ids(tokenizer, prompt))
            if max_length is not None and meta["prompt_tokens"] > max_length:
                context, question, answer_prefix, how = _truncate_split(
                    prompt, context, question, answer_prefix, tokenizer, max_length
                )
                meta["truncated"] = True
                meta["truncation"] = how
                meta["prompt_tokens_truncated"] = len(_token_ids(tokenizer, context + question + answer_prefix))
            meta["max_length"] = max_length
        samples.append(
            Sample(
                task=name,
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=[str(a) for a in row["answers"]],
                metric=LONGBENCH_METRICS[base],
                max_new_tokens=DATASET2MAXLEN[base],
                index=index,
                seed=0,
                meta=meta,
            )
        )
    return samples


def _truncate_split(
    prompt: str, context: str, question: str, answer_prefix: str, tokenizer: Any, max_length: int
) -> tuple[str, str, str, str]:
    """Apply the official middle truncation and recover the split.

    Normally the question and answer prefix survive intact in the kept last half, so the truncated
    prompt ends with them and the rest is the context ("middle"). If they do not (a question longer
    than half the budget), the context alone is cut in the middle so that the whole prompt fits
    ("context-middle").
    """
    truncated = truncate_middle(prompt, tokenizer, max_length)
    tail = question + answer_prefix
    if tail and truncated.endswith(tail) and len(truncated) > len(tail):
        return truncated[: len(truncated) - len(tail)], question, answer_prefix, "middle"
    tail_tokens = len(_token_ids(tokenizer, tail)) if tail else 0
    budget = max(max_length - tail_tokens, 2)
    return truncate_middle(context, tokenizer, budget), question, answer_prefix, "context-middle"
