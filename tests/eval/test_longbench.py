from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.longbench import (
    DATASET2MAXLEN,
    DATASET2PROMPT,
    LONGBENCH_DATASETS,
    NO_CHAT_TEMPLATE,
    load_longbench,
    split_prompt,
    truncate_middle,
)
from kvtrim.eval.metrics import LONGBENCH_METRICS, score_sample


def _write(directory: Path, name: str, rows: list[dict]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / f"{name}.jsonl").open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def _row(context: str = "CTX", input_: str = "IN", answers: list[str] | None = None, **extra) -> dict:
    return {
        "input": input_,
        "context": context,
        "answers": answers or ["ans"],
        "length": len(context.split()),
        "dataset": "x",
        "language": "en",
        "all_classes": None,
        "_id": "id0",
        **extra,
    }


def test_sixteen_datasets_and_config_tables() -> None:
    assert len(LONGBENCH_DATASETS) == 16
    assert set(DATASET2PROMPT) == set(DATASET2MAXLEN) == set(LONGBENCH_METRICS) == set(LONGBENCH_DATASETS)
    assert DATASET2MAXLEN == {
        "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
        "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
        "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
    }  # fmt: skip
    assert {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"} == NO_CHAT_TEMPLATE


def test_official_prompt_strings() -> None:
    assert DATASET2PROMPT["narrativeqa"] == (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: "
        "{context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
        "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    )
    assert "\n\nArticle: {context}\n\n Answer the question based on the above article" in DATASET2PROMPT["qasper"]
    assert DATASET2PROMPT["multi_news"].startswith(
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
    )
    assert DATASET2PROMPT["trec"] == (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    )
    assert DATASET2PROMPT["passage_retrieval_en"].endswith(
        'The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: '
    )
    assert DATASET2PROMPT["passage_count"].endswith("such as 1, 2, 3, and so on.\n\nThe final answer is: ")
    assert DATASET2PROMPT["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"
    assert DATASET2PROMPT["repobench-p"] == (
        "Please complete the code given below. \n{context}{input}Next line of code:\n"
    )
    for name, template in DATASET2PROMPT.items():
        assert template.count("{context}") == 1, name


_TEXT = st.text(alphabet=st.sampled_from("ab {}\n.:Type"), max_size=30)


@settings(max_examples=40, deadline=None)
@given(context=_TEXT, input_=_TEXT)
def test_split_reassembles_official_prompt(context: str, input_: str) -> None:
    row = {"context": context + " {input} {context}", "input": input_}
    for name in LONGBENCH_DATASETS:
        ctx, question, prefix = split_prompt(name, row)
        official = DATASET2PROMPT[name].format(**row)
        assert ctx + question + prefix == official, name
        assert row["context"] in ctx  # the document is always in the compressed part
        if "{input}" in DATASET2PROMPT[name] and input_.strip():
            assert input_.rstrip().removesuffix("Type:").strip() in question + prefix


def test_split_per_dataset() -> None:
    ctx, question, prefix = split_prompt("hotpotqa", _row(input_="Who?"))
    assert ctx.endswith("Only give me the answer and do not output any other words.")
    assert question == "\n\nQuestion: Who?\n" and prefix == "Answer:"
    ctx, question, prefix = split_prompt("trec", _row(input_="Question: What is a bat?\nType:"))
    assert ctx.endswith("\n\nCTX") and question == "\nQuestion: What is a bat?\n" and prefix == "Type:"
    _, question, prefix = split_prompt("triviaqa", _row(input_="Passage: p\nQuestion: q?\nAnswer:"))
    assert question == "\n\nPassage: p\nQuestion: q?\n" and prefix == "Answer:"
    _, question, prefix = split_prompt("samsum", _row(input_="Dialogue: hi\nSummary: "))
    assert question == "\n\nDialogue: hi\n" and prefix == "Summary: "
    _, question, prefix = split_prompt("trec", _row(input_="no cue"))
    assert question == "\nno cue" and prefix == ""
    _, question, prefix = split_prompt("gov_report", _row())
    assert question == "\n\n" and prefix == "Summary:"
    _, question, prefix = split_prompt("passage_retrieval_en", _row(input_="ABSTRACT"))
    assert question.startswith("\n\nABSTRACT\n\nPlease enter the number") and prefix == "The answer is: "
    ctx, question, prefix = split_prompt("repobench-p", _row(context="import os\n", input_="def f():\n"))
    assert ctx.endswith("import os\n") and question == "def f():\n" and prefix == "Next line of code:\n"
    assert split_prompt("lcc", _row(context="x = 1\n"))[1:] == ("", "Next line of code:\n")


def test_loader(tmp_path: Path) -> None:
    _write(tmp_path, "trec", [
        _row("Question: Where is X?\nType: Location", "Question: What is Y?\nType:", ["Description"],
             all_classes=["Location", "Description"]),
        _row("c2", "Question: Who?\nType:", ["Individual"], all_classes=["Individual"]),
    ])  # fmt: skip
    samples = load_longbench("trec", tmp_path)
    assert len(samples) == 2
    first = samples[0]
    assert first.task == "trec" and first.metric == "classification_score" and first.max_new_tokens == 64
    assert first.answer_prefix == "Type:"
    assert first.meta["chat_template"] is False and first.meta["first_line_only"] is True
    assert first.meta["all_classes"] == ["Location", "Description"]
    assert first.context + first.question + first.answer_prefix == DATASET2PROMPT["trec"].format(
        context="Question: Where is X?\nType: Location", input="Question: What is Y?\nType:"
    )
    assert score_sample(first, " Description\nLocation") == 1.0
    assert load_longbench("trec", tmp_path, limit=1) == samples[:1]

    _write(tmp_path, "samsum", [_row("d", "Dialogue: x\nSummary:", ["s"])])
    samsum = load_longbench("samsum", tmp_path)[0]
    assert samsum.meta["stop_on_newline"] is True and samsum.meta["min_new_tokens"] == 1
    _write(tmp_path, "qasper_e", [_row("article", "q?", ["yes"])])
    qasper = load_longbench("qasper_e", tmp_path)[0]
    assert qasper.meta["dataset"] == "qasper" and qasper.meta["longbench_e"] is True
    assert qasper.meta["chat_template"] is True and qasper.metric == "qa_f1_score"


def test_loader_errors(tmp_path: Path, bpe_tokenizer) -> None:
    with pytest.raises(FileNotFoundError) as excinfo:
        load_longbench("narrativeqa", tmp_path / "data")
    message = str(excinfo.value)
    assert "data_dir=" in message and "cannot download" in message and "narrativeqa.jsonl" in message
    with pytest.raises(InvalidParameterError, match="16 English"):
        load_longbench("dureader", tmp_path)
    with pytest.raises(InvalidParameterError, match="LongBench-E"):
        load_longbench("narrativeqa_e", tmp_path)
    with pytest.raises(InvalidParameterError, match="tokenizer"):
        load_longbench("trec", tmp_path, max_length=100)
    (tmp_path / "lcc.jsonl").write_text("{not json}\n", encoding="utf-8")
    with pytest.raises(InvalidParameterError, match=r"lcc\.jsonl:1"):
        load_longbench("lcc", tmp_path)


def test_truncate_middle(bpe_tokenizer) -> None:
    text = " ".join(f"w{i}" for i in range(600))
    ids = bpe_tokenizer(text)["input_ids"]
    assert len(ids) > 200
    out = truncate_middle(text, bpe_tokenizer, 200)
    assert out == bpe_tokenizer.decode(ids[:100], skip_special_tokens=True) + bpe_tokenizer.decode(
        ids[-100:], skip_special_tokens=True
    )
    assert out.startswith("w0 w1 w2") and out.endswith("w598 w599")
    assert truncate_middle("short text", bpe_tokenizer, 200) == "short text"


def test_loader_truncates_document_in_the_middle(tmp_path: Path, bpe_tokenizer) -> None:
    document = " ".join(f"fact{i}." for i in range(2000))
    _write(tmp_path, "hotpotqa", [_row(document, "Which fact comes first?", ["fact0"])])
    sample = load_longbench("hotpotqa", tmp_path, tokenizer=bpe_tokenizer, max_length=300)[0]
    assert sample.meta["truncated"] is True and sample.meta["truncation"] == "middle"
    assert sample.meta["prompt_tokens"] > 300
    assert sample.meta["prompt_tokens_truncated"] <= 302
    assert sample.question == "\n\nQuestion: Which fact comes first?\n" and sample.answer_prefix == "Answer:"
    assert sample.context.startswith("Answer the question based on the given passages.")
    assert "fact0." in sample.context and "fact1000." not in sample.context
    untouched = load_longbench("hotpotqa", tmp_path, tokenizer=bpe_tokenizer, max_length=100_000)[0]
    assert untouched.meta["truncated"] is False and untouched.meta["truncation"] == "none"
    assert "fact1000." in untouched.context


def test_loader_keeps_a_long_question_whole(tmp_path: Path, bpe_tokenizer) -> None:
    """If the question would be cut by the official truncation, only the document is shortened."""
    k = 10
    while len(bpe_tokenizer(" ".join(f"q{i}" for i in range(k)))["input_ids"]) < 380:
        k += 10
    question = " ".join(f"q{i}" for i in range(k))  # longer than half of max_length, shorter than all of it
    _write(tmp_path, "musique", [_row(" ".join(f"d{i}" for i in range(400)), question, ["x"])])
    sample = load_longbench("musique", tmp_path, tokenizer=bpe_tokenizer, max_length=600)[0]
    assert sample.meta["truncation"] == "context-middle"
    assert sample.question == f"\n\nQuestion: {question}\n"
    assert sample.context.startswith("Answer the question based on the given passages.")
    assert 300 < sample.meta["prompt_tokens_truncated"] <= 602
    assert "d0" in sample.context and "d399" in sample.context and "d200" not in sample.context
