from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.tasks import generate_task
from kvtrim.eval.tasks.base import TokenCounter
from kvtrim.eval.tasks.qa import read_hotpotqa, read_squad

FIXTURES = Path(__file__).parent.parent / "fixtures"
SQUAD = FIXTURES / "squad_dev_tiny.json"
HOTPOT = FIXTURES / "hotpot_dev_tiny.json"


def _documents(context: str) -> list[str]:
    return re.findall(r"Document \d+:\n(.*?)(?=\n\nDocument \d+:\n|\n\n$)", context, flags=re.S)


def test_readers_follow_ruler() -> None:
    qas, docs = read_squad(str(SQUAD))
    assert [qa.query for qa in qas] == [
        "When was the Halvard lighthouse built?",
        "What did the lamp burn before 1902?",
        "How long was the station cut off in the winter of 1888?",
        "What do mason bees seal their cells with?",
    ]  # unanswerable questions dropped, file order kept
    assert qas[0].answers == ["1871", "in 1871"]
    assert len(docs) == 5 and docs == sorted(docs)
    assert len(qas[0].more) == 2  # the other paragraphs of the same article
    hqas, hdocs = read_hotpotqa(str(HOTPOT))
    assert len(hqas) == 3 and hqas[0].answers == ["the Velka"]
    assert "Orrin Bridge\nThe Orrin Bridge is a stone arch bridge in Tarnow. It was completed in 1734." in hdocs
    assert len(hdocs) == 6  # deduplicated across questions


def test_qa_1_samples(bpe_tokenizer) -> None:
    samples = generate_task("qa_1", bpe_tokenizer, 700, 4, seed=3, squad_path=str(SQUAD))
    counter = TokenCounter(bpe_tokenizer)
    for sample in samples:
        assert sample.metric == "string_match_part" and sample.max_new_tokens == 32
        assert sample.answer_prefix == " Answer:"
        assert sample.context.startswith(
            "Answer the question based on the given documents. Only give me the answer and do not output any "
            "other words.\n\nThe following are given documents.\n\nDocument 1:\n"
        )
        assert sample.question.startswith(
            "Answer the question based on the given documents. Only give me the answer and do not output any "
            "other words.\n\nQuestion: "
        )
        total = counter.count(sample.context + sample.question + sample.answer_prefix) + 32
        assert total <= 700 and total == sample.meta["length"]
        shown = _documents(sample.context)
        assert len(shown) == sample.meta["num_docs"]
        gold = [shown[i - 1] for i in sample.meta["gold_document_numbers"]]
        assert any(answer in gold[0] for answer in sample.answers)
    assert samples[0].question.endswith("Question: When was the Halvard lighthouse built?")
    assert all(sample.meta["num_docs"] >= 3 for sample in samples)
    assert samples == generate_task("qa_1", bpe_tokenizer, 700, 4, seed=3, squad_path=str(SQUAD))


def test_qa_2_samples(bpe_tokenizer) -> None:
    samples = generate_task("qa_2", bpe_tokenizer, 600, 3, seed=1, hotpotqa_path=str(HOTPOT))
    first = samples[0]
    assert first.answers == ["the Velka"]
    assert first.question.endswith("Question: Which river flows through the city where the Orrin Bridge stands?")
    shown = _documents(first.context)
    gold_numbers = first.meta["gold_document_numbers"]
    assert len(gold_numbers) == 3  # every context paragraph of the question is included
    assert any("The Velka river flows through Tarnow" in shown[i - 1] for i in gold_numbers)


def test_qa_needs_data_files(bpe_tokenizer, tmp_path: Path) -> None:
    with pytest.raises(InvalidParameterError, match="squad_path"):
        generate_task("qa_1", bpe_tokenizer, 1024, 1)
    with pytest.raises(InvalidParameterError, match="hotpotqa_path"):
        generate_task("qa_2", bpe_tokenizer, 1024, 1)
    with pytest.raises(FileNotFoundError, match="squad_path"):
        generate_task("qa_1", bpe_tokenizer, 1024, 1, squad_path=str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"data": [{"title": "x"}]}', encoding="utf-8")
    with pytest.raises(InvalidParameterError, match="SQuAD"):
        generate_task("qa_1", bpe_tokenizer, 1024, 1, squad_path=str(bad))
    with pytest.raises(InvalidParameterError, match="only 4 usable questions"):
        generate_task("qa_1", bpe_tokenizer, 1024, 5, squad_path=str(SQUAD))
    with pytest.raises(InvalidParameterError, match="does not take option"):
        generate_task("qa_1", bpe_tokenizer, 1024, 1, hotpotqa_path=str(HOTPOT))
