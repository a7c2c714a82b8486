"""KV-Compress's squared-attention metric and its scorer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtrim.errors import InvalidParameterError
from kvtrim.scoring.base import LayerView
from kvtrim.scoring.observation import LayerObservation
from kvtrim.scoring.squared_attention import INITIALIZED, SquaredAttentionScorer, squared_attention

torch.set_num_threads(1)


def _naive(q, qpos, k, kpos, scaling, buffer, kernel):
    """Loop version: per query head, sum over queries of squared probabilities, max-pool, then sum the group."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    out = torch.zeros(1, hkv, k.shape[2])
    for h in range(hq):
        kv = h // group
        per_head = torch.zeros(k.shape[2])
        for j in range(q.shape[2]):
            vis = kpos[0, kv] <= qpos[0, j]
            logits = (q[0, h, j] @ k[0, kv].T * scaling).masked_fill(~vis, float("-inf"))
            p = torch.softmax(logits, -1)
            per_head += (p**2) * (kpos[0, kv] <= qpos[0, j] - buffer)
        if kernel > 1:
            per_head = F.max_pool1d(per_head[None, None], kernel, 1, kernel // 2)[0, 0]
        out[0, kv] += per_head
    return out


@pytest.mark.parametrize(("buffer", "kernel", "chunk"), [(0, 7, 1024), (3, 1, 2), (0, 1, 3), (2, 7, 1)])
def test_squared_attention_matches_naive(buffer, kernel, chunk):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g)
    k = torch.randn(1, 2, 20, 8, generator=g)
    qpos = torch.arange(14, 20)[None]
    kpos = torch.arange(20).expand(1, 2, 20).clone()
    got = squared_attention(q, qpos, k, kpos, 0.5, buffer=buffer, kernel=kernel, chunk=chunk)
    torch.testing.assert_close(got, _naive(q, qpos, k, kpos, 0.5, buffer, kernel), atol=1e-6, rtol=1e-5)


def test_pooling_is_per_query_head_before_the_group_sum():
    # Two query heads with peaks at different places: pooling per head then summing gives 2 where both pooled
    # windows overlap; summing first then pooling would give at most the single larger peak sum.
    q = torch.zeros(1, 2, 1, 2)
    k = torch.zeros(1, 1, 9, 2)
    q[0, 0, 0, 0] = q[0, 1, 0, 1] = 50.0
    k[0, 0, 2, 0] = k[0, 0, 6, 1] = 1.0
    kpos = torch.arange(9).expand(1, 1, 9).clone()
    got = squared_attention(q, torch.tensor([[8]]), k, kpos, 1.0, kernel=7)
    assert got[0, 0, 4].item() == pytest.approx(2.0, abs=1e-4)


def _view(n=24, window=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, n, 8, generator=g)
    obs = LayerObservation(
        queries=torch.randn(1, 4, window, 8, generator=g), positions=torch.arange(n - window, n)[None]
    )
    return LayerView(
        layer_idx=0,
        num_layers=1,
        keys=keys,
        values=keys.clone(),
        positions=torch.arange(n).expand(1, 2, n).clone(),
        context_lengths=torch.tensor([n]),
        observation=obs,
        stats={},
        module=None,
        scaling=8**-0.5,
    )


def test_scorer_prefill_and_running_metric():
    view = _view()
    scorer = SquaredAttentionScorer(window=4, kernel=7)
    expected = squared_attention(
        view.observation.queries[:, :, -4:], view.observation.positions[:, -4:], view.keys, view.positions, view.scaling
    )
    torch.testing.assert_close(scorer.score(view), expected)
    # under a continuous schedule the statistic is replaced by the prefill metric once, then only read
    running = torch.full((1, 2, 24), 9.0)
    view.stats["attn_sq_sum"] = running
    torch.testing.assert_close(scorer.score(view), expected)
    torch.testing.assert_close(running, expected)
    assert view.observation.extra[INITIALIZED]
    running += 1.0  # decoding adds squared attention
    torch.testing.assert_close(scorer.score(view), expected + 1.0)


def test_full_variant_uses_every_recorded_query():
    view = _view(window=24)
    scorer = SquaredAttentionScorer(window=None, kernel=1, buffer=10)
    expected = squared_attention(
        view.observation.queries,
        view.observation.positions,
        view.keys,
        view.positions,
        view.scaling,
        buffer=10,
        kernel=1,
    )
    torch.testing.assert_close(scorer.score(view), expected)
    assert scorer.observation.window >= 1 << 20


def test_bad_parameters():
    for kwargs, name in (({"window": 0}, "window"), ({"kernel": 4}, "kernel"), ({"buffer": -1}, "buffer")):
        with pytest.raises(InvalidParameterError, match=name):
            SquaredAttentionScorer(**kwargs)


@pytest.mark.parametrize("layout", ["prompt", "permuted", "empty_slots", "padded_batch"])
@pytest.mark.parametrize(("buffer", "kernel"), [(0, 1), (3, 7)])
def test_query_steps_over_every_prompt_query_equal_one_step(layout, buffer, kernel):
    """KVC-full's metric in several query steps (each leaving out the slots none of its queries sees) equals the
    metric in one step over every slot, whatever order the slots hold positions in."""
    g = torch.Generator().manual_seed(1)
    b, s = (2, 40) if layout == "padded_batch" else (1, 40)
    q = torch.randn(b, 6, s, 8, generator=g)
    k = torch.randn(b, 3, s, 8, generator=g)
    qpos = torch.arange(s).expand(b, s).clone()
    kpos = torch.arange(s).expand(b, 3, s).clone()
    if layout == "permuted":
        kpos = torch.stack([torch.randperm(s, generator=g) for _ in range(3)])[None]
    elif layout == "empty_slots":
        kpos[:, 1, 30:] = -1
        kpos[:, 2, ::5] = -1
    elif layout == "padded_batch":
        qpos[1, :10] = -1  # a left-padded row of a batch
        kpos[1, :, :10] = -1
    steps = squared_attention(q, qpos, k, kpos, 0.5, buffer=buffer, kernel=kernel, chunk=16)
    whole = squared_attention(q, qpos, k, kpos, 0.5, buffer=buffer, kernel=kernel, chunk=4096)
    torch.testing.assert_close(steps, whole, atol=1e-6, rtol=1e-5)
    if layout in ("prompt", "permuted"):  # the loop reference has no empty slots or padding
        torch.testing.assert_close(steps, _naive(q, qpos, k, kpos, 0.5, buffer, kernel), atol=1e-6, rtol=1e-5)


def test_query_steps_read_only_the_slots_their_queries_see(monkeypatch):
    import kvtrim.scoring.squared_attention as module

    widths = []
    original = module.attention_probabilities

    def recording(query, keys, mask, scaling):
        widths.append(keys.shape[2])
        return original(query, keys, mask, scaling)

    monkeypatch.setattr(module, "attention_probabilities", recording)
    s = 40
    q, k = torch.randn(1, 4, s, 8), torch.randn(1, 2, s, 8)
    pos = torch.arange(s)
    squared_attention(q, pos[None], k, pos.expand(1, 2, s).clone(), 0.5, kernel=1, chunk=16)
    assert widths == [16, 32, 40]  # a prompt's slots in position order: each step reads up to its last query
    widths.clear()
    squared_attention(q[:, :, -8:], pos[None, -8:], k, pos.expand(1, 2, s).clone(), 0.5, kernel=1, chunk=16)
    assert widths == [40]  # one step (an observation window): every slot, no host read
