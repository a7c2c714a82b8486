"""TriAttention's trigonometric score (arXiv 2604.04921) on hand-made tensors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from conftest import tiny_model
from kvtrim.scoring.observation import LayerObservation
from kvtrim.scoring.trigonometric import (
    TrigonometricScorer,
    geometric_offsets,
    query_centres,
    trigonometric_scores,
)

D = 16  # tiny_model's head_dim


def _rotary():
    return LlamaRotaryEmbedding(tiny_model("llama", layers=1).config)


def _rope(rotary, x, positions):
    """transformers' rotation of ``x`` ``[1, h, s, d]`` at ``positions`` ``[s]``."""
    cos, sin = rotary(x, positions[None])
    out, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return out


def test_geometric_offsets_double_up_to_the_longest():
    assert geometric_offsets(1).tolist() == [1.0]
    assert geometric_offsets(10).tolist() == [1.0, 2.0, 4.0, 8.0]
    assert geometric_offsets(65536).numel() == 17


def test_the_series_is_the_centre_s_rotary_logit_averaged_over_the_future_offsets():
    rotary = _rotary()
    g = torch.Generator().manual_seed(0)
    centre, keys = torch.randn(D, generator=g), torch.randn(5, D, generator=g)
    key_pos, now = torch.tensor([0, 3, 17, 40, 99]), 100
    offsets = geometric_offsets(64)
    rotated_keys = _rope(rotary, keys[None, None], key_pos)[0, 0]
    expected = torch.zeros(5)
    for o in offsets.tolist():
        q = _rope(rotary, centre[None, None, None], torch.tensor([now + int(o)]))[0, 0, 0]
        expected += rotated_keys @ q / len(offsets)
    re, im = centre[: D // 2], centre[D // 2 :]
    magnitude = torch.sqrt(re**2 + im**2)  # every query at the centre: the norm term is zero
    out = trigonometric_scores(centre.view(1, 1, 1, D), magnitude.view(1, 1, 1, -1), keys[None, None],
                               (now - key_pos)[None, None], rotary.inv_freq, offsets)  # fmt: skip
    assert torch.allclose(out[0, 0, 0], expected, atol=1e-4)


def test_queries_without_a_centre_score_keys_by_their_band_norms():
    # two opposite queries: the centre is zero, so the distance term vanishes and E|q_f|·|k_f| remains
    queries = torch.stack([torch.ones(D), -torch.ones(D)])[None, None]  # [1, 1, 2, D]
    centre, magnitude = query_centres(queries, torch.ones(1, 2, dtype=torch.bool))
    assert torch.equal(centre, torch.zeros(1, 1, D)) and torch.allclose(magnitude, torch.full((1, 1, D // 2), 2**0.5))
    keys = torch.zeros(1, 1, 2, D)
    keys[0, 0, 0, 0], keys[0, 0, 1, :2] = 3.0, 1.0  # band norms (3, 0 …) and (1, 1, 0 …)
    out = trigonometric_scores(centre.view(1, 1, 1, D), magnitude.view(1, 1, 1, -1), keys,
                               torch.tensor([[[5, 9]]]), _rotary().inv_freq, geometric_offsets(8))  # fmt: skip
    assert torch.allclose(out[0, 0, 0], torch.tensor([3.0, 2.0]) * 2**0.5)


def test_the_centre_s_phase_sets_the_preferred_distance():
    """One band: a key whose phase against the centre is −ω·10 gets the most attention at distance 10."""
    inv_freq = _rotary().inv_freq
    f = 4  # ω = 10000^(−8/16) = 0.01
    omega = float(inv_freq[f])
    centre = torch.zeros(D)
    centre[f] = 1.0
    key = torch.zeros(D)
    key[f], key[f + D // 2] = math.cos(omega * 10), math.sin(omega * 10)  # q̄·conj(k) = exp(−iω·10)
    distances = torch.arange(0, 300, 10)
    magnitude = torch.zeros(1, 1, 1, D // 2)
    magnitude[..., f] = 1.0  # every query at the centre: no norm term
    out = trigonometric_scores(centre.view(1, 1, 1, D), magnitude,
                               key.expand(1, 1, len(distances), D), distances[None, None] - 1, inv_freq,
                               geometric_offsets(1))[0, 0, 0]  # fmt: skip  # offset 1: the next token
    assert int(out.argmax()) == 1  # distance 10
    assert bool((out[1:].diff() < 0).all())  # then falling with the distance (ω·Δ stays under π here)
    assert torch.allclose(out, torch.cos(omega * (distances.float() - 10)), atol=1e-5)


def test_the_scorer_unrotates_the_recorded_queries_and_the_stored_keys():
    model = tiny_model("llama", layers=1, heads=4, kv_heads=2)
    rotary = LlamaRotaryEmbedding(model.config)
    g = torch.Generator().manual_seed(3)
    raw_q, raw_k = torch.randn(1, 4, 6, D, generator=g), torch.randn(1, 2, 9, D, generator=g)
    qpos, kpos = torch.arange(3, 9), torch.arange(9)
    view = SimpleNamespace(
        observation=LayerObservation(queries=_rope(rotary, raw_q, qpos), positions=qpos[None]),
        module=SimpleNamespace(config=model.config), keys=_rope(rotary, raw_k, kpos), positions=kpos.expand(1, 2, 9),
        context_lengths=torch.tensor([9]), layer_idx=0,
    )  # fmt: skip
    out = TrigonometricScorer(offset_max=1024).score(view)
    centre, magnitude = query_centres(raw_q, torch.ones(1, 6, dtype=torch.bool))
    ref = trigonometric_scores(centre.view(1, 2, 2, D), magnitude.view(1, 2, 2, -1), raw_k, (9 - kpos).expand(1, 2, 9),
                               rotary.inv_freq, geometric_offsets(1024)).amax(dim=2)  # fmt: skip
    assert torch.allclose(out, ref, atol=1e-4)
