"""Key re-rotation (kvpress KeyRerotationPress): kept keys rotated to contiguous positions after eviction."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import kvtrim
from conftest import tiny_model
from kvtrim.errors import InvalidParameterError
from kvtrim.methods import get_method, method_info
from kvtrim.selection.rerotation import contiguous_positions, rotate_keys


def _rope(model, x, positions):
    """transformers' own rotation of pre-RoPE ``x`` ``[1, h, s, d]`` at ``positions`` ``[s]``."""
    cos, sin = LlamaRotaryEmbedding(model.config)(x, positions[None])
    out, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return out


def test_rotating_back_and_forward_equals_rotating_directly_to_the_new_position():
    model = tiny_model("llama")
    inv_freq = LlamaRotaryEmbedding(model.config).inv_freq
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(1, 2, 6, 16, generator=g)
    old, new = torch.tensor([3, 40, 41, 90, 500, 1000]), torch.tensor([0, 1, 2, 3, 4, 5])
    stored = _rope(model, raw, old)
    moved = rotate_keys(stored, (new - old).expand(1, 2, 6), inv_freq)
    tol = 1e-4  # fp32 angles of up to 1000 radians, in transformers' rotation as in this one
    assert torch.allclose(moved, _rope(model, raw, new), atol=tol)
    back = rotate_keys(stored, -old.expand(1, 2, 6), inv_freq)  # to position 0: the pre-RoPE key itself
    assert torch.allclose(back, raw, atol=tol)
    assert torch.allclose(rotate_keys(back, new.expand(1, 2, 6), inv_freq), moved, atol=tol)
    assert torch.equal(rotate_keys(stored, torch.zeros(1, 2, 6, dtype=torch.long), inv_freq), stored)


def test_kept_entries_are_packed_contiguously_to_end_where_the_context_ends():
    # slots out of position order; -1 an empty slot; a second head keeping other entries
    positions = torch.tensor([[[5, 0, 2, 7, 1, -1, 3], [5, 0, 2, 7, 1, -1, 3]]])
    kept = torch.tensor([[[1, 0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0, 1]]], dtype=torch.bool)
    out = contiguous_positions(positions, kept, torch.tensor([8]))
    # head 0 keeps positions 2, 5, 7 -> 5, 6, 7; head 1 keeps 0, 1, 2, 3, 7 -> 3, 4, 5, 6, 7
    assert out[0, 0].tolist() == [6, 0, 5, 7, 1, -1, 3]
    assert out[0, 1].tolist() == [5, 3, 5, 7, 4, -1, 6]
    assert bool((out >= positions).all())  # a kept entry never moves back
    full = torch.arange(6)[None, None]  # nothing evicted: nothing moves
    assert torch.equal(contiguous_positions(full, torch.ones(1, 1, 6, dtype=torch.bool), torch.tensor([6])), full)


def _prefill(model, method, ids, **params):
    cache = kvtrim.make_cache(model, method, ratio=0.5, **params)
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache.compress()
    return cache


def test_the_compressed_store_holds_contiguous_keys_rotated_for_their_new_positions():
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(2))
    plain, moved = _prefill(model, "snapkv", ids), _prefill(model, "key_rerotation", ids)
    inv_freq = LlamaRotaryEmbedding(model.config).inv_freq
    for a, b in zip(plain.layers, moved.layers, strict=True):
        n = b.store.positions.shape[-1]
        assert torch.equal(b.store.positions, torch.arange(40 - n, 40).expand_as(b.store.positions))
        expected = rotate_keys(a.store.keys, b.store.positions - a.store.positions, inv_freq)
        assert torch.allclose(b.store.keys, expected, atol=1e-6) and torch.equal(a.store.values, b.store.values)


def test_decoding_continues_as_at_position_n_after_the_kept_entries_at_0_to_n_minus_1():
    """kvpress's layout: the n kept keys at 0 … n−1 in a plain cache and the next token at position n."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = _prefill(model, "key_rerotation", ids)
    inv_freq = LlamaRotaryEmbedding(model.config).inv_freq
    ref = DynamicCache()
    for i, layer in enumerate(cache.layers):
        n = layer.store.positions.shape[-1]
        shift = torch.full_like(layer.store.positions, -(40 - n))
        ref.update(rotate_keys(layer.store.keys, shift, inv_freq), layer.store.values.clone(), i)
    nxt = torch.tensor([[17]])
    with torch.inference_mode():
        ours = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
        theirs = model(input_ids=nxt, past_key_values=ref, position_ids=torch.tensor([[n]]),
                       attention_mask=torch.ones(1, n + 1, dtype=torch.long), use_cache=True).logits  # fmt: skip
    assert torch.allclose(ours, theirs, atol=1e-5)
    plain = _prefill(model, "snapkv", ids)
    with torch.inference_mode():
        unmoved = model(input_ids=nxt, past_key_values=plain, use_cache=True).logits
    assert not torch.allclose(unmoved, ours, atol=1e-4)  # the distances did change


def test_rerotation_composes_with_a_merging_method_and_is_labelled():
    pipe = get_method("key_rerotation", base="cam")
    assert pipe.merge is not None and pipe.rerotate is not None
    assert "re-rotates kept keys" in method_info("key_rerotation").capabilities.labels()
    with pytest.raises(InvalidParameterError, match="would be lost"):
        get_method("cam", base="key_rerotation")
    with pytest.raises(InvalidParameterError, match="must name another registry method"):
        get_method("key_rerotation", base="key_rerotation")
