"""FINCH's question attention (Corallo & Papotti, TACL 2024): the question's queries choose the context entries."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from conftest import random_text, tiny_model
from kvtrim.api import question_starts
from kvtrim.errors import InvalidParameterError
from kvtrim.methods import get_method
from kvtrim.scoring.question_attention import QuestionAttentionScorer, question_attention_scores


def _scores(probs, query_positions, n_keys, start, normalize=True):
    probs = torch.tensor(probs)[None, None]  # one row, one query head over one KV head
    keys = torch.arange(n_keys)[None, None]
    return question_attention_scores(probs, torch.tensor([query_positions]), keys, torch.tensor([start]), normalize)[
        0, 0
    ]


def test_only_the_question_s_queries_choose_the_context():
    # 4 context entries (0..3), the question at positions 4 and 5. Query 3 (context) looks at entry 0, the
    # question's queries at entry 2: entry 2 wins, entry 0 scores nothing.
    probs = [
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # position 3, context
        [0.0, 0.0, 1.0, 0.0, 0.0, 0.0],  # position 4, question
        [0.0, 0.0, 1.0, 0.0, 0.0, 0.0],  # position 5, question
    ]
    s = _scores(probs, [3, 4, 5], 6, start=4, normalize=False)
    assert s[:4].tolist() == pytest.approx([0.0, 0.0, 1.0, 0.0])
    assert s[4:].tolist() == pytest.approx([2.0, 2.0])  # the question's entries above every context entry


def test_rows_are_weighted_by_the_entries_each_query_sees():
    # Uniform causal attention: position 4 sees 5 entries (1/5 each), position 5 sees 6 (1/6 each). Weighted by
    # the counts every query gives every entry it sees 1: the context scores are equal, not tilted by the
    # question's length.
    probs = [[0.2] * 5 + [0.0], [1 / 6] * 6]
    s = _scores(probs, [4, 5], 6, start=4)
    assert s[:4].tolist() == pytest.approx([1.0] * 4)
    raw = _scores(probs, [4, 5], 6, start=4, normalize=False)
    assert raw[:4].tolist() == pytest.approx([(0.2 + 1 / 6) / 2] * 4)


def test_padding_queries_and_empty_slots_take_no_part():
    probs = torch.tensor([[[[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]]]])  # a padding query, then the question at 1
    keys = torch.tensor([[[0, 1, -1]]])
    s = question_attention_scores(probs, torch.tensor([[-1, 1]]), keys, torch.tensor([1]), True)[0, 0]
    assert s[0].item() == pytest.approx(1.0)  # 0.5 × 2 entries seen, one question query
    assert s[1].item() == pytest.approx(2.0)  # the question's own entry: max + 1


def test_question_starts_is_where_the_prompt_leaves_its_context_part():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 9, 7, 8, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ctx = torch.tensor([[0, 5, 6], [5, 6, 7]])
    ctx_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert question_starts(ids, mask, ctx, ctx_mask).tolist() == [2, 2]  # row 1: token 7 merged into 9


@pytest.mark.parametrize("params", [{"window": 0}, {"window": 1.5}, {"max_question": 0}, {"normalize": "yes"}])
def test_bad_parameters_are_refused(params):
    with pytest.raises(InvalidParameterError, match=next(iter(params))):
        QuestionAttentionScorer(**params)


def test_finch_needs_the_question_or_a_window(tokenizer):
    model = tiny_model("qwen2", layers=2)
    ctx = random_text(200, seed=4)
    with pytest.raises(InvalidParameterError, match="question-aware"):
        kvtrim.generate(model, tokenizer, ctx, "q?", method="finch", ratio=0.5, max_new_tokens=2)
    res = kvtrim.generate(
        model, tokenizer, ctx, "q?", method="finch", ratio=0.5, max_new_tokens=2, method_params={"window": 8}
    )
    assert res.stats.kv_entries_after == kvtrim.BudgetSpec(ratio=0.5).keep_count(res.stats.context_tokens) * 2 * 2
    with pytest.raises(InvalidParameterError, match="prefill in one pass"):
        kvtrim.generate(
            model,
            tokenizer,
            ctx,
            "q?",
            method="finch",
            ratio=0.5,
            max_new_tokens=2,
            question_aware=True,
            prefill_chunk=64,
        )


def test_finch_keeps_the_question_and_the_entries_it_attends(tokenizer):
    model = tiny_model("qwen2", layers=2)
    ctx, question = random_text(200, seed=4), "where is the key?"
    session = kvtrim.Session(model, tokenizer, ctx, question, methods=["finch"])
    start = int(session.question_start[0])
    n = session.context_tokens_per_row[0]
    assert n - start >= len(question)  # byte tokens: the separator, the question and the template's end
    spec = kvtrim.BudgetSpec(ratio=0.75)
    cache = session.prefill.cache.clone(get_method("finch"), spec)
    cache.compress()
    for layer in cache.kv_layers:
        kept = layer.store.positions[0]
        assert bool((kept >= 0).all()) and kept.shape[-1] == spec.keep_count(n)
        assert set(range(start, n)) <= set(kept[0].tolist())  # every question token survives


def test_finch_with_chunks_keeps_each_chunk_its_share(tokenizer):
    model = tiny_model("qwen2", layers=2)
    res = kvtrim.generate(model, tokenizer, random_text(200, seed=4), "q?", method="finch", ratio=0.5,
                          max_new_tokens=2, question_aware=True, method_params={"chunk": 100})  # fmt: skip
    n = res.stats.context_tokens
    keep = kvtrim.BudgetSpec(ratio=0.5).keep_count(n)
    sizes = [min(100, n - start) for start in range(0, n, 100)]
    assert res.stats.kv_entries_after == sum(max(1, c * keep // n) for c in sizes) * 2 * 2  # 2 layers, 2 KV heads
    with pytest.raises(InvalidParameterError, match="chunk"):
        get_method("finch", chunk=0)
