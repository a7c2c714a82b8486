"""Non-causal chunked attention and Compactor's blend (arXiv 2507.08143), on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from kvtrim.errors import InvalidParameterError
from kvtrim.scoring.leverage import leverage_scores, unrotate_keys
from kvtrim.scoring.noncausal_attention import (
    ChunkAttentionScorer,
    LeverageAttentionScorer,
    chunk_attention,
    zscore,
)


def _brute(q, k, scaling, chunk):
    """Column sums of full (non-causal) softmax attention inside each chunk of ``chunk`` positions."""
    n = k.shape[0]
    out = torch.zeros(n)
    for c in range(0, n, chunk):
        logits = (q[c : c + chunk] @ k[c : c + chunk].T) * scaling
        out[c : c + chunk] = torch.softmax(logits, -1).sum(0)
    return out


def test_chunk_attention_is_non_causal_and_stays_inside_the_chunk():
    torch.manual_seed(0)
    n, chunk = 10, 4
    q, k = torch.randn(1, 1, n, 8), torch.randn(1, 1, n, 8)
    pos = torch.arange(n).view(1, n)
    scored = torch.ones(1, 1, n, dtype=torch.bool)
    cols = chunk_attention(q, pos, k, pos.view(1, 1, n), 0.5, chunk, scored, torch.ones(1, n, dtype=torch.bool))
    torch.testing.assert_close(cols[0, 0], _brute(q[0, 0], k[0, 0], 0.5, chunk))
    # each chunk hands out exactly one unit of attention per query: 4, 4 and 2
    torch.testing.assert_close(cols[0, 0].view(-1)[:8].view(2, 4).sum(-1), torch.tensor([4.0, 4.0]))
    torch.testing.assert_close(cols[0, 0, 8:].sum(), torch.tensor(2.0))
    # the first key of a chunk is attended by later queries of its chunk (no causal mask)
    q_only_last = torch.zeros(1, n, dtype=torch.bool)
    q_only_last[0, 3] = True
    cols = chunk_attention(q, pos, k, pos.view(1, 1, n), 0.5, chunk, scored, q_only_last)
    assert float(cols[0, 0, 0]) > 0 and float(cols[0, 0, 4:].abs().sum()) == 0


def test_chunk_attention_uses_positions_so_left_padding_changes_nothing():
    torch.manual_seed(1)
    n, chunk = 7, 3
    q, k = torch.randn(1, 2, n, 4), torch.randn(1, 1, n, 4)  # two query heads share one KV head
    pos = torch.arange(n).view(1, n)
    ones = torch.ones(1, 1, n, dtype=torch.bool)
    plain = chunk_attention(q, pos, k, pos.view(1, 1, n), 1.0, chunk, ones, torch.ones(1, n, dtype=torch.bool))
    pad = 2
    qp = torch.cat([torch.full((1, 2, pad, 4), 9.0), q], 2)
    kp = torch.cat([torch.full((1, 1, pad, 4), 9.0), k], 2)
    pp = torch.cat([torch.full((1, pad), -1), pos], 1)
    valid = (pp >= 0).view(1, 1, -1)
    padded = chunk_attention(qp, pp, kp, pp.view(1, 1, -1), 1.0, chunk, valid, pp >= 0)
    assert float(padded[..., :pad].abs().sum()) == 0
    torch.testing.assert_close(padded[..., pad:], plain)


def test_zscore_over_the_scored_entries_of_a_row():
    x = torch.tensor([[[1.0, 2.0, 3.0, 100.0]]])
    scored = torch.tensor([[[True, True, True, False]]])
    z = zscore(x, scored)
    torch.testing.assert_close(z, torch.tensor([[[-1.0, 0.0, 1.0, 0.0]]]))


@pytest.mark.parametrize(
    ("cls", "params", "match"),
    [
        (ChunkAttentionScorer, {"chunk": 0}, "chunk"),
        (ChunkAttentionScorer, {"scaled": 1}, "scaled"),
        (LeverageAttentionScorer, {"blending": -1.0}, "blending"),
        (LeverageAttentionScorer, {"sink_start": -1}, "sink_start"),
        (LeverageAttentionScorer, {"sink_end": 1.5}, "sink_end"),
    ],
)
def test_bad_parameters_are_refused(cls, params, match):
    with pytest.raises(InvalidParameterError, match=match):
        cls(**params)


def _view_of_tiny_model(method: str, n: int = 40, **params):
    from conftest import tiny_model
    from kvtrim.compression.compressor import BudgetSpec, layer_views
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.integration.cache import KVTrimCache
    from kvtrim.methods import get_method

    model = tiny_model("llama", layers=1, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (1, n), generator=torch.Generator().manual_seed(5))
    pipe = get_method(method, **params)
    cache = KVTrimCache(1, pipe, BudgetSpec(budget=10), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return pipe, layer_views(cache, torch.tensor([n]))[0]


def test_compactor_blend_is_leverage_plus_attention_on_the_middle_entries():
    n = 40
    blend, view = _view_of_tiny_model("compactor", n, blending=0.0, chunk=8, sink_start=8, sink_end=4)
    _, plain_view = _view_of_tiny_model("noncausal_attention", n, chunk=8)
    scores = blend.scorer.score(view)
    assert float(scores[..., :8].abs().sum()) == 0 and float(scores[..., -4:].abs().sum()) == 0
    # blending 0: the attention part alone; chunks start at position 8, so positions 8..35 form the chunks
    # 8-15, 16-23, 24-31 of the plain scorer and a last one cut at 36; the 3-wide smoothing reads one neighbour,
    # so positions 9..30 score as in the plain scorer
    attention = ChunkAttentionScorer(chunk=8).score(plain_view)
    middle = slice(9, 31)
    assert torch.equal(scores[..., middle].argsort(-1), attention[..., middle].argsort(-1))
    # the blend is linear in `blending`, and its leverage term is the z-scored leverage of the middle entries'
    # pre-RoPE keys (centred over those entries only)
    twice = LeverageAttentionScorer(blending=2.0, chunk=8, sink_start=8, sink_end=4).score(view)
    scored = torch.zeros(1, 2, n, dtype=torch.bool)
    scored[..., 8:36] = True
    leverage = leverage_scores(unrotate_keys(view.keys, view.positions, view.module.config), scored)
    torch.testing.assert_close(twice - scores, 2.0 * zscore(leverage, scored), atol=1e-4, rtol=0)


def test_chunk_attention_on_a_longer_padded_prompt_with_unscored_ends_matches_brute_force():
    torch.manual_seed(6)
    n, chunk, pad = 45, 8, 3
    q, k = torch.randn(1, 2, n, 4), torch.randn(1, 1, n, 4)
    qp = torch.cat([torch.zeros(1, 2, pad, 4), q], 2)
    kp = torch.cat([torch.zeros(1, 1, pad, 4), k], 2)
    pos = torch.cat([torch.full((1, pad), -1), torch.arange(n).view(1, n)], 1)
    start, end = 5, 4  # positions [5, 41) take part; chunks start at 5
    scored = ((pos >= start) & (pos < n - end)).view(1, 1, -1)
    cols = chunk_attention(qp, pos, kp, pos.view(1, 1, -1), 0.7, chunk, scored, scored[:, 0], start)
    expected = torch.zeros(1, 2, n + pad)
    for h in range(2):
        expected[0, h, pad + start : pad + n - end] = _brute(q[0, h, start : n - end], k[0, 0, start : n - end], 0.7,
                                                             chunk)
    torch.testing.assert_close(cols, expected)


def test_unscaled_logits_are_kvpress_raw_dot_products():
    _, view = _view_of_tiny_model("noncausal_attention", 24, chunk=8)
    raw = ChunkAttentionScorer(chunk=8, scaled=False).score(view)
    scaled = ChunkAttentionScorer(chunk=8).score(view)
    assert not torch.allclose(raw, scaled)
    # raw q·k is the scaled attention with the model's 1/√d scale replaced by 1
    view.scaling = 1.0
    torch.testing.assert_close(raw, ChunkAttentionScorer(chunk=8).score(view))
