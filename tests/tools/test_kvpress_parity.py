"""tools/kvpress_parity.py's pure parts: reading kept positions back from key rows, and the agreement figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import kvpress_parity


def test_kept_positions_are_read_back_from_gathered_key_rows():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 10, 4, generator=g)  # [heads, n, d]
    keep = [[7, 1, 4], [0, 9, 3]]
    kept = torch.stack([full[h, idx] for h, idx in enumerate(keep)])
    assert kvpress_parity.kept_by_matching(full, kept) == [[1, 4, 7], [0, 3, 9]]


def test_a_row_that_is_not_a_prefill_key_is_an_error():
    full = torch.zeros(1, 3, 2)
    with pytest.raises(RuntimeError, match="matches no prefill key row"):
        kvpress_parity.kept_by_matching(full, torch.ones(1, 1, 2))


def test_agreement_figures():
    a = [[[0, 1, 2], [3, 4]], [[5], [6, 7]]]
    b = [[[0, 1, 2], [3, 9]], [[5], [6, 7, 8]]]
    got = kvpress_parity.compare(a, b)
    assert got["identical_heads"] == 0.5
    assert got["mean_jaccard"] == pytest.approx((1 + 1 / 3 + 1 + 2 / 3) / 4)
    assert got["max_head_difference"] == 1 and got["kept_kvpress"] == 8 and got["kept_kvtrim"] == 9


def test_report_names_the_methods_and_the_failures():
    report = {"ratio": 0.5, "tokens": 8, "kvpress_side": {"kvpress": "0.5.5", "transformers": "5.2.0"},
              "rows": [{"press": "KnormPress", "method": "knorm", "status": "ok", "identical_heads": 1.0,
                        "mean_jaccard": 1.0, "max_head_difference": 0, "kept_kvpress": 4, "kept_kvtrim": 4},
                       {"press": "RandomPress", "method": None, "status": "no kvtrim method"}]}  # fmt: skip
    text = kvpress_parity.markdown(report)
    assert "| KnormPress | `knorm` | 100.0 % | 1.000 | 0 | 4 / 4 | - | ok |" in text
    assert "| RandomPress | - |" in text and "no kvtrim method" in text


def test_answers_are_compared_word_by_word():
    same = kvpress_parity.compare_answers(" a data sink.", " a data sink.")
    assert same["answer_identical"] is True and same["answer_common_words"] == 3
    differ = kvpress_parity.compare_answers(" a data sink. Then", " a data bucket. Then")
    assert differ == {"answer_kvpress": " a data sink. Then", "answer_kvtrim": " a data bucket. Then",
                      "answer_identical": False, "answer_common_words": 2}  # fmt: skip
    # whitespace counts for identity (the answers are decoded from token ids), not for the shared words
    assert kvpress_parity.compare_answers("a b", "a b\n")["answer_identical"] is False
    assert kvpress_parity.compare_answers("a b", "a b\n")["answer_common_words"] == 2
    missing = kvpress_parity.compare_answers(None, "a")
    assert missing["answer_identical"] is None and kvpress_parity.answer_cell(missing) == "-"
    assert kvpress_parity.answer_cell(same) == "identical"
    assert kvpress_parity.answer_cell(differ) == "differ (2 leading words shared)"


def test_report_lists_the_answers_the_full_cache_and_the_variants():
    ok = {"status": "ok", "identical_heads": 1.0, "mean_jaccard": 1.0, "max_head_difference": 0, "kept_kvpress": 4,
          "kept_kvtrim": 4}  # fmt: skip
    report = {"ratio": 0.5, "tokens": 8, "question": "Q?", "max_new_tokens": 4,
              "full_cache": kvpress_parity.compare_answers("x y", "x y"),
              "kvpress_side": {"kvpress": "0.5.5", "transformers": "5.2.0"},
              "rows": [{"press": "KnormPress", "method": "knorm", **ok, **kvpress_parity.compare_answers("x", "x")},
                       {"press": "PyramidKVPress", "method": "pyramidkv", "variant": "kvpress's layer counts", **ok,
                        **kvpress_parity.compare_answers("x y", "x z")}]}  # fmt: skip
    text = kvpress_parity.markdown(report)
    assert 'Uncompressed cache: identical (kvpress "x y", kvtrim "x y")' in text
    assert "| KnormPress | `knorm` | 100.0 % | 1.000 | 0 | 4 / 4 | identical | ok |" in text
    assert "| `pyramidkv` (kvpress's layer counts) |" in text and "differ (1 leading words shared)" in text
    assert '- PyramidKVPress (kvpress\'s layer counts): kvpress "x y", kvtrim "x z"' in text


def test_kept_positions_are_read_from_boolean_masks():
    masks = [[torch.tensor([True, False, True]), torch.tensor([False, False, True])]]
    assert kvpress_parity._kept_from_masks(masks) == [[[0, 2], [2]]]


def test_a_question_fed_token_by_token_gives_the_same_answer():
    from transformers import DynamicCache

    from conftest import tiny_model
    from kvtrim.runtime import feed, greedy_decode

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(3)
    ids, question = torch.randint(3, 200, (1, 12), generator=g), torch.randint(3, 200, (1, 5), generator=g)
    answers = []
    for token_by_token in (False, True):
        cache = DynamicCache()
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True)
            answers.append(kvpress_parity._greedy(model, cache, 12, question, 6, feed, greedy_decode, token_by_token))
    assert len(answers[0]) == 6 and answers[0] == answers[1]


def test_ratio_outside_its_range_is_refused():
    with pytest.raises(SystemExit):
        kvpress_parity.main(["kvtrim", "--out", "x", "--ratio", "1.0"])


def test_pruned_key_channels_are_read_back_from_zeroed_columns():
    g = torch.Generator().manual_seed(1)
    full = torch.randn(2, 5, 6, generator=g)  # [heads, n, d]
    pruned = full.clone()
    pruned[0][:, [1, 4]] = 0  # head 0 prunes channels 1 and 4, head 1 channels 0, 2 and 5
    pruned[1][:, [5, 0, 2]] = 0
    assert kvpress_parity.pruned_channels(full, pruned) == [[1, 4], [0, 2, 5]]
    # a channel that is zero in the prefill too was not pruned by the press
    full[1][:, 3] = 0
    pruned[1][:, 3] = 0
    assert kvpress_parity.pruned_channels(full, pruned)[1] == [0, 2, 5]


def test_a_channel_neither_kept_nor_zeroed_is_an_error():
    full = torch.ones(1, 3, 2)
    changed = full.clone()
    changed[0, 0, 1] = 2.0
    with pytest.raises(RuntimeError, match="neither the prefill's nor zeroed"):
        kvpress_parity.pruned_channels(full, changed)


def test_pruned_channels_of_the_kept_ones_and_their_agreement():
    assert kvpress_parity.pruned_of([0, 2, 3], 6) == [1, 4, 5]
    theirs = [[[1, 4, 5], [0, 1, 2]]]  # [layer][head] -> pruned channels
    mine = [[kvpress_parity.pruned_of([0, 2, 3], 6), kvpress_parity.pruned_of([3, 4, 5], 6)]]
    got = kvpress_parity.compare(theirs, mine)
    assert got["identical_heads"] == 1.0 and got["kept_kvpress"] == got["kept_kvtrim"] == 6


def test_streaming_heads_follow_kvtrims_duo_rule():
    # 90 heads, 512 tokens, ratio 0.5 (keep 256), window 64: ceil(90 * 256 / 448) = 52
    assert kvpress_parity.duo_streaming_heads(90, 512, 0.5, 64) == 52
    assert kvpress_parity.duo_streaming_heads(90, 512, 0.0, 64) == 0
    assert kvpress_parity.duo_streaming_heads(90, 512, 0.95, 64) == 90  # capped at every head
    assert kvpress_parity.duo_streaming_heads(4, 8, 0.5, 16) == 4  # the window covers the context


def test_a_subset_replaces_its_rows_and_keeps_the_others():
    before = [{"press": "A", "v": 0}, {"press": "B", "v": 0}, {"press": "B", "v": 0, "variant": "x"},
              {"press": "C", "v": 0}]  # fmt: skip
    after = [{"press": "B", "v": 1}, {"press": "D", "v": 1}]
    assert kvpress_parity.merge_rows(before, after) == [
        {"press": "A", "v": 0}, {"press": "B", "v": 1}, {"press": "C", "v": 0}, {"press": "D", "v": 1}]  # fmt: skip


def test_report_names_the_unit_of_a_channel_row():
    report = {"ratio": 0.5, "tokens": 8, "kvpress_side": {"kvpress": "0.5.5", "transformers": "5.2.0"},
              "rows": [{"press": "ThinKPress", "method": "think", "unit": "pruned key channels", "status": "ok",
                        "identical_heads": 1.0, "mean_jaccard": 1.0, "max_head_difference": 0, "kept_kvpress": 6,
                        "kept_kvtrim": 6}]}  # fmt: skip
    assert "| ThinKPress | `think` (pruned key channels) | 100.0 % |" in kvpress_parity.markdown(report)


def test_lazy_layers_and_positions_in_a_span():
    kept = [[[0, 1, 2, 3], [0, 1, 2, 3]], [[0, 3], [0, 2]], [[0, 1, 2, 3], [1, 3]]]  # [layer][head], context 4
    assert kvpress_parity.lazy_layers(kept, 4) == [1]
    assert kvpress_parity.count_between(kept, 1, 3) == 2 + 2 + 0 + 1 + 2 + 1
    assert kvpress_parity.positions_from(kept, 2)[1] == [[3], [2]]


def test_zeroed_prefill_channels_change_only_what_they_touch():
    from transformers import DynamicCache

    from conftest import tiny_model
    from kvtrim.runtime import feed, greedy_decode

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(5)
    ids, question = torch.randint(3, 200, (1, 10), generator=g), torch.randint(3, 200, (1, 3), generator=g)
    none = [[[], []], [[], []]]
    cache = DynamicCache()
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
        plain = kvpress_parity._greedy(model, cache, 10, question, 5, feed, greedy_decode)
    assert kvpress_parity._zeroed_prefill_answer(model, ids, none, question, 5) == plain
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    every = [[list(range(head_dim))] * 2] * 2  # every prefill key zeroed: another cache, still an answer
    assert len(kvpress_parity._zeroed_prefill_answer(model, ids, every, question, 5)) <= 5


def test_report_names_the_unit_and_the_variant_together():
    row = {"press": "ThinKPress", "method": "think", "unit": "pruned key channels", "variant": "v", "status": "ok",
           "identical_heads": 1.0, "mean_jaccard": 1.0, "max_head_difference": 0, "kept_kvpress": 6,
           "kept_kvtrim": 6}  # fmt: skip
    report = {"ratio": 0.5, "tokens": 8, "kvpress_side": {"kvpress": "0.5.5", "transformers": "5.2.0"}, "rows": [row]}
    assert "| ThinKPress | `think` (pruned key channels; v) |" in kvpress_parity.markdown(report)


def test_a_subset_must_name_presses_the_kvpress_half_ran(tmp_path):
    import gzip
    import json

    with gzip.open(tmp_path / "kvpress.json.gz", "wt") as fh:
        json.dump({"presses": {"KnormPress": {}}}, fh)
    with pytest.raises(SystemExit, match="ThinKPress"):
        kvpress_parity.main(["kvtrim", "--out", str(tmp_path), "--presses", "KnormPress,ThinKPress"])


def test_gathered_positions_are_checked_against_the_prefill_rows():
    g = torch.Generator().manual_seed(2)
    full = torch.randn(2, 8, 3, generator=g)  # [heads, n, d]
    indices = torch.tensor([[1, 4, 6], [0, 2, 7]])
    kept = torch.stack([full[h, idx] for h, idx in enumerate(indices)])
    assert kvpress_parity.gathered_positions(full, kept, indices) == [[1, 4, 6], [0, 2, 7]]
    with pytest.raises(RuntimeError, match="not the prefill's rows"):
        kvpress_parity.gathered_positions(full, kept, torch.tensor([[1, 4, 6], [0, 2, 6]]))


def test_rerotation_keeps_the_selection_of_its_base_and_packs_the_store():
    from conftest import tiny_model

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(7)
    ids, question = torch.randint(3, 200, (1, 16), generator=g), torch.randint(3, 200, (1, 2), generator=g)
    params = {"window": 4, "kernel": 3, "pooling": "avg"}
    plain, _ = kvpress_parity._kvtrim_run(model, ids, "snapkv", params, 0.5, question, 2)
    moved, _ = kvpress_parity._kvtrim_run(model, ids, kvpress_parity.rerotation_pipeline(model, params, 0.5), None,
                                          0.5, question, 2)  # fmt: skip
    assert moved == plain and all(len(h) == 8 for layer in moved for h in layer)


def test_original_positions_need_a_packed_store():
    record = {0: [[0, 3, 5], [1, 2, 4]]}
    assert kvpress_parity.original_positions(record, [[[3, 4, 5], [3, 4, 5]]], 6) == [[[0, 3, 5], [1, 2, 4]]]
    with pytest.raises(RuntimeError, match="layer 0 head 1"):
        kvpress_parity.original_positions(record, [[[3, 4, 5], [1, 2, 4]]], 6)


def test_an_unscored_span_is_evicted_first():
    from conftest import tiny_model
    from kvtrim.runtime import resolve_method

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(8)
    ids, question = torch.randint(3, 200, (1, 12), generator=g), torch.randint(3, 200, (1, 2), generator=g)
    pipe, _ = resolve_method("snapkv", 0.5, None, {"window": 2}, model)
    kept, _ = kvpress_parity._kvtrim_run(model, ids, kvpress_parity.opening_unscored(pipe, 2, 6), None, 0.5,
                                         question, 2)  # fmt: skip
    assert all(len(h) == 6 and not set(h) & {2, 3, 4, 5} for layer in kept for h in layer)


def _reconstruction_case(tmp_path, seed: int, question_len: int):
    """A tiny Llama, 16 context ids, ``question_len`` question ids and the params kvzip / kvgrad need (a saved
    tokenizer, 2 sinks)."""
    from conftest import byte_tokenizer, tiny_model

    byte_tokenizer().save_pretrained(tmp_path / "tok")
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(seed)
    ids, question = torch.randint(3, 200, (1, 16), generator=g), torch.randint(3, 200, (1, question_len), generator=g)
    return model, ids, question, {"tokenizer": str(tmp_path / "tok"), "n_sink": 2}


@pytest.mark.parametrize("method", ["kvzip", "kvgrad"])
def test_a_span_unscored_or_left_out_of_the_scoring_softmax_is_evicted_first(tmp_path, method):
    from kvtrim.integration import cache
    from kvtrim.runtime import resolve_method
    from kvtrim.scoring import gradient_attribution

    model, ids, question, params = _reconstruction_case(tmp_path, seed=9, question_len=2)
    runs = []
    for wrap in (kvpress_parity.opening_unscored, kvpress_parity.opening_left_out):
        pipe, _ = resolve_method(method, 0.5, None, params, model)
        runs.append(kvpress_parity._kvtrim_run(model, ids.clone(), wrap(pipe, 2, 7), None, 0.5, question, 2)[0])
    for kept in runs:
        assert sum(len(h) for layer in kept for h in layer) == 2 * 2 * 8
        assert not {p for layer in kept for h in layer for p in h} & set(range(2, 7))
    # put back
    assert gradient_attribution.attributed_attention.__name__ == "attributed_attention"
    assert cache.record.__name__ == "record"


def _scores(model, ids, question, pipe) -> list[torch.Tensor]:
    """The scores ``pipe``'s scorer gives every layer of ``ids`` (``[batch, kv_heads, n]`` each)."""
    seen = []
    score = pipe.scorer.score
    pipe.scorer.score = lambda view: seen.append(score(view)) or seen[-1]
    kvpress_parity._kvtrim_run(model, ids, pipe, None, 0.5, question, 1)
    return seen


@pytest.mark.parametrize("method", ["kvzip", "kvgrad"])
def test_keys_left_out_of_the_softmax_raise_the_others_scores(tmp_path, method):
    from kvtrim.runtime import resolve_method

    model, ids, question, params = _reconstruction_case(tmp_path, seed=10, question_len=1)
    plain = _scores(model, ids.clone(), question, resolve_method(method, 0.5, None, params, model)[0])
    pipe = kvpress_parity.opening_left_out(resolve_method(method, 0.5, None, params, model)[0], 2, 7)
    left_out = _scores(model, ids.clone(), question, pipe)
    for before, after in zip(plain, left_out, strict=True):
        assert torch.equal(after[..., 2:7], torch.zeros_like(after[..., 2:7]))
        rest = torch.cat([before[..., 7:], after[..., 7:]], dim=0)
        # the same queries over fewer keys: every other entry's attention is as high or higher
        assert bool((rest[1] >= rest[0] * (1 - 1e-5)).all()) and bool((rest[1] > rest[0] * (1 + 1e-4)).any())


def test_a_variant_whose_scoring_pass_did_not_run_is_an_error(tmp_path):
    from conftest import byte_tokenizer, tiny_model
    from kvtrim.runtime import resolve_method

    byte_tokenizer().save_pretrained(tmp_path / "tok")
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    g = torch.Generator().manual_seed(11)
    ids, question = torch.randint(3, 200, (1, 16), generator=g), torch.randint(3, 200, (1, 1), generator=g)
    params = {"tokenizer": str(tmp_path / "tok"), "n_sink": 2}
    kvpress_parity._kvtrim_run(model, ids, "kvzip", params, 0.5, question, 1)
    pipe = kvpress_parity.opening_left_out(resolve_method("kvzip", 0.5, None, params, model)[0], 2, 7)
    # the same ids tensor: kvzip reuses its scores, the replay whose softmax the variant changes never runs
    with pytest.raises(RuntimeError, match="record was not called"):
        kvpress_parity._kvtrim_run(model, ids, pipe, None, 0.5, question, 1)
    with pytest.raises(TypeError, match="neither kvzip's nor kvgrad's"):
        kvpress_parity.opening_left_out(resolve_method("snapkv", 0.5, None, {}, model)[0], 2, 7)
