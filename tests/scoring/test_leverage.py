"""Leverage scores (Compactor) and CurDKV's window-normalized norms, on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from kvtrim.errors import InvalidParameterError
from kvtrim.scoring.base import LayerView
from kvtrim.scoring.leverage import (
    LocalLeverageScorer,
    leverage_scores,
    unrotate_keys,
    window_normalized_norms,
)
from kvtrim.scoring.observation import LayerObservation
from kvtrim.scoring.rope import cos_sin, rope_frequencies, rotate_half


def _brute_leverage(x: torch.Tensor) -> torch.Tensor:
    c = x.double() - x.double().mean(0)
    return torch.diag(c @ torch.linalg.pinv(c.T @ c) @ c.T)


def test_leverage_matches_the_hat_matrix_and_sums_to_the_rank():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 20, 4)
    valid = torch.ones(1, 2, 20, dtype=torch.bool)
    scores = leverage_scores(x, valid)
    for h in range(2):
        torch.testing.assert_close(scores[0, h].double(), _brute_leverage(x[0, h]), atol=1e-6, rtol=0)
    # centred data of rank 4 (20 generic rows, 4 columns): the scores sum to 4
    torch.testing.assert_close(scores.sum(-1), torch.full((1, 2), 4.0), atol=1e-4, rtol=0)
    assert bool((scores >= 0).all()) and bool((scores <= 1).all())


def test_an_outlier_key_has_the_top_leverage_and_an_invertible_map_changes_nothing():
    torch.manual_seed(1)
    x = torch.randn(1, 1, 30, 3) * 0.1
    x[0, 0, 7] = torch.tensor([5.0, -4.0, 3.0])  # far outside the cloud
    valid = torch.ones(1, 1, 30, dtype=torch.bool)
    scores = leverage_scores(x, valid)
    assert int(scores[0, 0].argmax()) == 7 and float(scores[0, 0, 7]) > 0.9
    mix = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0], [1.0, 0.0, 1.0]])  # invertible
    torch.testing.assert_close(leverage_scores(x @ mix, valid), scores, atol=1e-5, rtol=0)


def test_padding_takes_no_part_in_the_leverage():
    torch.manual_seed(2)
    x = torch.randn(1, 1, 12, 3)
    valid = torch.ones(1, 1, 12, dtype=torch.bool)
    padded = torch.cat([torch.full((1, 1, 3, 3), 100.0), x], dim=2)
    padded_valid = torch.cat([torch.zeros(1, 1, 3, dtype=torch.bool), valid], dim=2)
    scores = leverage_scores(padded, padded_valid)
    assert bool((scores[..., :3] == 0).all())
    torch.testing.assert_close(scores[..., 3:], leverage_scores(x, valid), atol=1e-6, rtol=0)


def test_window_normalized_norms_by_position():
    x = torch.tensor([1.0, 1.0, 2.0, 3.0, 4.0]).view(1, 1, 5, 1)
    positions = torch.tensor([[[-1, 0, 1, 2, 3]]])  # one padding slot; windows {0, 1} and {2, 3}
    scores = window_normalized_norms(x, positions, window=2)
    torch.testing.assert_close(scores, torch.tensor([[[0.0, 1 / 5, 4 / 5, 9 / 25, 16 / 25]]]))
    # after an eviction positions skip: the window is still one of positions, not of slots
    positions = torch.tensor([[[0, 1, 4, 5, 9]]])
    scores = window_normalized_norms(x, positions, window=4)  # windows {0, 1}, {4, 5}, {9}
    torch.testing.assert_close(scores, torch.tensor([[[0.5, 0.5, 4 / 13, 9 / 13, 1.0]]]))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("key", [0.5, 0.5]), ("value", [0.2, 0.8]), ("kv_avg", [0.35, 0.65]), ("kv_product", [0.1, 0.4])],
)
def test_local_leverage_kinds(kind, expected):
    keys = torch.tensor([1.0, 1.0]).view(1, 1, 2, 1)
    values = torch.tensor([1.0, 2.0]).view(1, 1, 2, 1)
    view = LayerView(
        layer_idx=0, num_layers=1, keys=keys, values=values, positions=torch.tensor([[[0, 1]]]),
        context_lengths=torch.tensor([2]), observation=LayerObservation(), stats={}, module=None, scaling=1.0,
    )
    scores = LocalLeverageScorer(kind=kind, window=16).score(view)
    torch.testing.assert_close(scores, torch.tensor([[expected]]))


@pytest.mark.parametrize(("params", "match"), [({"kind": "keys"}, "kind"), ({"window": 0}, "window")])
def test_local_leverage_rejects_bad_parameters(params, match):
    with pytest.raises(InvalidParameterError, match=match):
        LocalLeverageScorer(**params)


def test_unrotate_keys_inverts_the_rotary_embedding():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    torch.manual_seed(3)
    raw = torch.randn(1, 2, 6, 8)
    positions = torch.tensor([0, 3, 4, 9, 10, 11]).view(1, 1, 6).expand(1, 2, 6)
    inv_freq, _ = rope_frequencies(config, 8, raw.device)
    cos, sin = cos_sin(positions, inv_freq)
    rotated = raw * cos + rotate_half(raw) * sin  # transformers' apply_rotary_pos_emb
    torch.testing.assert_close(unrotate_keys(rotated, positions, config), raw, atol=1e-5, rtol=0)


def test_key_leverage_scorer_end_to_end_is_the_leverage_of_the_k_proj_output():
    from conftest import tiny_model
    from kvtrim.compression.compressor import BudgetSpec, layer_views
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.integration.cache import KVTrimCache
    from kvtrim.methods import get_method

    model = tiny_model("llama", layers=1, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(4))
    pipe = get_method("leverage")
    cache = KVTrimCache(1, pipe, BudgetSpec(budget=10), auto_compress=False)
    captured = {}
    attn = model.model.layers[0].self_attn
    hook = attn.k_proj.register_forward_hook(lambda m, i, o: captured.setdefault("k", o))
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    hook.remove()
    view = layer_views(cache, torch.tensor([30]))[0]
    ours = pipe.scorer.score(view)
    k = captured["k"].view(30, 2, 16).transpose(0, 1)  # pre-RoPE keys [kv_heads, seq, head_dim]
    for h in range(2):
        torch.testing.assert_close(ours[0, h].double(), _brute_leverage(k[h]), atol=1e-4, rtol=0)
