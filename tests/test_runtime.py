"""kvtrim.runtime: prefill (plain and chunked), feed, greedy decoding with a step callback, method resolution."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import GenerationConfig

from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.methods import get_method
from kvtrim.runtime import (
    Prefill,
    eos_ids,
    feed,
    greedy_decode,
    observation_of,
    positions,
    resolve_method,
    tokenize,
)
from kvtrim.scoring.observation import ObservationSpec


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids():
    return byte_tokenizer()(random_text(150, seed=4), return_tensors="pt")["input_ids"]


def _prefill(model, ids, observation=None):
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        return Prefill.plain(model, ids, torch.ones_like(ids), observation or ObservationSpec())


def _decode(model, pre: Prefill, steps: int, **kwargs):
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        return greedy_decode(model, pre.compressed(None, None).cache, pre.mask, pre.logits, steps, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chunked_prefill_without_a_method_equals_the_plain_prefill(family, ids):
    model = tiny_model(family)
    plain = _prefill(model, ids)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        chunked = Prefill.chunked(model, ids, torch.ones_like(ids), 40)
    assert chunked.chunk == 40 and plain.chunk is None
    torch.testing.assert_close(chunked.logits, plain.logits, atol=1e-5, rtol=1e-4)
    assert torch.equal(chunked.mask, plain.mask)
    assert chunked.before.entries == plain.before.entries == 2 * 2 * ids.shape[1]  # layers x kv heads x tokens
    for a, b in zip(chunked.cache.layers, plain.cache.layers, strict=True):
        torch.testing.assert_close(a.store.keys, b.store.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a.store.values, b.store.values, atol=1e-5, rtol=1e-4)
    assert _decode(model, chunked, 15).tokens == _decode(model, plain, 15).tokens


def test_greedy_decode_matches_model_generate(model, ids):
    steps = 20
    pre = _prefill(model, ids)
    ours = _decode(model, pre, steps)  # no EOS: exactly `steps` tokens
    config = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=steps, eos_token_id=None)
    with torch.inference_mode():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    assert ours.tokens == [reference[0, ids.shape[1] :].tolist()]
    assert ours.steps == steps - 1  # the last token chosen is not fed back


def test_on_step_is_called_once_per_token_and_eos_stops(model, ids):
    pre = _prefill(model, ids)
    free = _decode(model, pre, 12).tokens[0]
    stop_at = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # a token first chosen at step i
    calls = []

    def on_step(step, tokens, attentions):
        calls.append((step, tokens.tolist(), attentions))

    out = _decode(model, pre, 12, eos={free[stop_at]}, on_step=on_step)
    assert out.tokens == [free[:stop_at]]  # EOS ends the row and is not part of the answer
    assert [c[0] for c in calls] == list(range(stop_at + 1))  # every chosen token, the EOS included
    assert [c[1][0] for c in calls] == free[: stop_at + 1]
    assert all(c[2] is None for c in calls)  # attentions only when asked for
    assert out.steps == stop_at


def test_on_step_can_end_a_row(model, ids):
    pre = _prefill(model, ids)
    out = _decode(model, pre, 12, on_step=lambda step, tokens, attentions: step == 3)
    assert len(out.tokens[0]) == 4 and out.tokens == [_decode(model, pre, 4).tokens[0]]


def test_decode_cpu_time_leaves_out_time_the_process_waits(model, ids):
    """cpu_seconds counts this process's CPU work, not time it waits (as when other jobs hold a shared CPU)."""
    pre = _prefill(model, ids)
    out = _decode(model, pre, 4, on_step=lambda step, tokens, attentions: time.sleep(0.25))
    assert out.seconds >= 4 * 0.25
    assert 0 < out.cpu_seconds < out.seconds - 0.75


def test_feed_uses_logical_positions_under_left_padding(model):
    tok = byte_tokenizer()
    texts = [random_text(60, seed=1), random_text(45, seed=2)]
    batch_ids, batch_mask = tokenize(tok, texts, True)
    assert batch_mask[1, :15].sum() == 0  # the shorter row is left-padded
    assert positions(batch_mask, 3)[1].tolist() == [42, 43, 44]
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        batch = Prefill.plain(model, batch_ids, batch_mask, ObservationSpec())
        solo_ids, solo_mask = tokenize(tok, texts[1:], True)
        solo = Prefill.plain(model, solo_ids, solo_mask, ObservationSpec())
        torch.testing.assert_close(batch.logits[1], solo.logits[0], atol=1e-4, rtol=1e-4)
        a = greedy_decode(model, batch.cache, batch.mask, batch.logits, 8)
        b = greedy_decode(model, solo.cache, solo.mask, solo.logits, 8)
    assert a.tokens[1] == b.tokens[0]


def test_feed_returns_attentions_when_asked(model, ids):
    from transformers import DynamicCache

    from kvtrim.calibration.needles import attention_implementation

    with torch.inference_mode(), attention_implementation(model, "eager"):
        cache = DynamicCache(config=model.config)
        first = feed(model, cache, torch.ones_like(ids[:, :0]), ids[:, :-1])
        last = feed(model, cache, first.mask, ids[:, -1:], output_attentions=True)
    assert first.attentions is None and len(last.attentions) == model.config.num_hidden_layers
    assert last.attentions[0].shape == (1, 4, 1, ids.shape[1]) and last.mask.shape == ids.shape


def test_compressed_copies_leave_the_prefill_untouched(model, ids):
    pipeline = get_method("snapkv")
    pre = _prefill(model, ids, pipeline.observation)
    entries = pre.cache.stats().entries
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        out = pre.compressed(pipeline, BudgetSpec(budget=30))
        full = pre.compressed(None, None)
    assert out.report is not None and out.cache.stats().entries == 2 * 2 * 30
    assert full.report is None and full.cache.stats().entries == entries == pre.cache.stats().entries
    with pytest.raises(InvalidParameterError, match="did not record"):
        _prefill(model, ids).compressed(pipeline, BudgetSpec(budget=30))


def test_chunked_prefill_compresses_its_own_cache_in_place(model, ids):
    pipeline, spec = get_method("snapkv"), BudgetSpec(budget=30)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        pre = Prefill.chunked(model, ids, torch.ones_like(ids), 50, pipeline, spec)
        assert pre.cache.compressions == 2  # between the three chunks
        out = pre.compressed(pipeline, spec)
    assert out.cache is pre.cache and pre.cache.compressions == 3


def test_resolve_method_validates_before_any_work(model):
    assert resolve_method(None, None, None) == (None, None)
    assert resolve_method("full", None, None) == (None, None)
    pipeline, spec = resolve_method("snapkv", 0.5, None, {"window": 8}, model)
    assert pipeline.name == "snapkv" and spec.ratio == 0.5
    with pytest.raises(InvalidParameterError, match="keeps everything"):
        resolve_method("full", 0.5, None)
    with pytest.raises(InvalidParameterError, match=r"'window': 0.*snapkv"):
        resolve_method("snapkv", 0.5, None, {"window": 0})
    with pytest.raises(InvalidParameterError, match="not to a built Pipeline"):
        resolve_method(get_method("snapkv"), 0.5, None, {"window": 8})
    with pytest.raises(InvalidParameterError, match="registry name or a Pipeline"):
        resolve_method(3, 0.5, None)


def test_observation_of_merges_what_the_methods_need():
    merged = observation_of(["snapkv", None, "full", get_method("lagkv")])
    assert merged.covers(get_method("snapkv").observation) and merged.covers(get_method("lagkv").observation)
    assert observation_of([]) == ObservationSpec()


def test_eos_ids_joins_the_generation_config_and_the_tokenizer(model):
    tok = byte_tokenizer()
    assert eos_ids(model, tok) == {2}
    assert eos_ids(model, tok, GenerationConfig(eos_token_id=[7, 9])) == {2, 7, 9}
