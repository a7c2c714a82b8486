"""The defining property of each kvpress-family part, on small hand-made tensors (KeyDiff, Expected Attention,
ChunkKV, KVzip, the global threshold budget)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from conftest import tiny_model
from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.global_threshold import GlobalThresholdBudget
from kvtrim.compression.compressor import BudgetSpec, layer_views
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method
from kvtrim.scoring.expected_attention import expected_logits, future_rotation, query_statistics, unrotate
from kvtrim.scoring.key_diff import key_diff_scores
from kvtrim.scoring.reconstruction import ReconstructionScorer, reconstruction_feed
from kvtrim.scoring.rope import rope_frequencies
from kvtrim.selection.chunk import ChunkSelector, chunk_keep_mask


# ------------------------------------------------------------------------------------------------- KeyDiff
def test_keydiff_keeps_the_keys_least_similar_to_the_mean_direction():
    keys = torch.tensor([[1.0, 0.1], [1.0, -0.1], [2.0, 0.0], [0.0, 1.0], [5.0, 5.0]])[None, None]  # [1, 1, 5, 2]
    valid = torch.tensor([[[True, True, True, True, False]]])  # the last slot is padding
    scores = key_diff_scores(keys, valid)
    unit = keys[0, 0, :4] / keys[0, 0, :4].norm(dim=-1, keepdim=True)
    anchor = unit.mean(0) / unit.mean(0).norm()
    assert torch.allclose(scores[0, 0, :4], -(unit @ anchor), atol=1e-6)
    assert int(scores[0, 0, :4].argmax()) == 3  # the orthogonal key is the most distinctive
    assert int(scores[0, 0, :4].argmin()) == 0  # [1, 0.1] lies closest to the anchor (tilted up by [0, 1])
    other = keys.clone()
    other[0, 0, 4] = torch.tensor([-3.0, 1.0])  # padding never moves the anchor
    assert torch.equal(key_diff_scores(other, valid)[0, 0, :4], scores[0, 0, :4])


# -------------------------------------------------------------------------------------- Expected Attention
def _config(head_dim=8, theta=10000.0):
    return LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                       rope_parameters={"rope_type": "default", "rope_theta": theta})


def test_unrotate_inverts_transformers_rotary_embedding():
    cfg = _config()
    rotary = LlamaRotaryEmbedding(cfg)
    q = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([[-1, 0, 3, 4, 17, 250]])
    cos, sin = rotary(q, pos.clamp(min=0))
    rotated, _ = apply_rotary_pos_emb(q, q, cos, sin)
    inv_freq, scale = rope_frequencies(cfg, 8, q.device)
    assert torch.allclose(inv_freq, rotary.inv_freq) and scale == 1.0
    assert torch.allclose(unrotate(rotated, pos, inv_freq, scale), q, atol=1e-5)


def test_future_rotation_is_the_mean_of_the_rotation_matrices():
    cfg = _config()
    inv_freq, scale = rope_frequencies(cfg, 8, torch.device("cpu"))
    rotary = LlamaRotaryEmbedding(cfg)
    ctx, n_future = torch.tensor([5, 40]), 7
    mean_r = future_rotation(ctx, n_future, inv_freq, scale)  # [2, 8, 8]
    eye = torch.eye(8)
    for row in range(2):
        mats = []
        for p in range(int(ctx[row]), int(ctx[row]) + n_future):  # R_p e_j column by column via transformers
            cos, sin = rotary(eye[None, None], torch.tensor([[p]]))
            rotated, _ = apply_rotary_pos_emb(eye[None, None], eye[None, None], cos, sin)
            mats.append(rotated[0, 0].T)  # row j of the output is R_p e_j
        assert torch.allclose(mean_r[row], torch.stack(mats).mean(0), atol=1e-5)


def test_expected_logit_equals_a_monte_carlo_expectation():
    gen = torch.Generator().manual_seed(0)
    d, s = 4, 0.5
    mean = torch.tensor([0.3, -0.2, 0.5, 0.1])
    a = torch.randn(d, d, generator=gen) * 0.4
    cov = a @ a.T
    keys = torch.randn(1, 1, 3, d, generator=gen)
    ours = expected_logits(keys, mean.view(1, 1, d), cov.view(1, 1, d, d), s)[0, 0, 0]  # [3]
    samples = torch.distributions.MultivariateNormal(mean, cov).sample((400_000,))
    brute = torch.exp(s * samples @ keys[0, 0].T).mean(0).log()  # log E[exp(s qᵀk)]
    assert torch.allclose(ours, brute, atol=0.02)
    no_cov = expected_logits(keys, mean.view(1, 1, d), None, s)[0, 0, 0]
    assert torch.allclose(no_cov, s * keys[0, 0] @ mean)


def test_query_statistics_skip_sinks_and_padding():
    q = torch.arange(12, dtype=torch.float32).view(1, 1, 6, 2)
    pos = torch.tensor([[-1, 0, 1, 2, 3, 4]])
    mean, cov = query_statistics(q, pos, n_sink=2, use_covariance=True)
    used = q[0, 0, 3:]  # positions 2, 3, 4
    assert torch.allclose(mean[0, 0], used.mean(0))
    assert torch.allclose(cov[0, 0], torch.cov(used.T, correction=0))


def test_expected_attention_scorer_end_to_end_matches_statistics_of_true_pre_rope_queries():
    model = tiny_model("llama", layers=1, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(3))
    pipe = get_method("expected_attention", n_future=16, n_sink=2)
    cache = KVTrimCache(1, pipe, BudgetSpec(budget=10), auto_compress=False)
    captured = {}
    attn = model.model.layers[0].self_attn
    hook = attn.q_proj.register_forward_hook(lambda m, i, o: captured.setdefault("q", o))
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    hook.remove()
    view = layer_views(cache, torch.tensor([30]))[0]
    ours = pipe.scorer.score(view)
    # brute force from the q_proj output (pre-RoPE queries) and explicit formulas
    q = captured["q"].view(1, 30, 4, 16).transpose(1, 2)[:, :, 2:].float()  # drop the 2 sinks
    mu, cov = q.mean(2), torch.einsum("bhnd,bhne->bhde", q - q.mean(2, keepdim=True), q - q.mean(2, keepdim=True)) / 28
    inv_freq, _ = rope_frequencies(model.config, 16, torch.device("cpu"))
    rot = future_rotation(torch.tensor([30]), 16, inv_freq, 1.0)[0]
    mu, cov = mu @ rot.T, rot @ cov @ rot.T
    k = view.keys[0].float()  # [2, 30, 16]
    logit = torch.stack([attn.scaling * k[h // 2] @ mu[0, h] + 0.5 * attn.scaling**2 *
                         torch.einsum("sd,de,se->s", k[h // 2], cov[0, h], k[h // 2]) for h in range(4)])
    logit[:, :2] = -math.inf
    probs = torch.softmax(logit, -1).view(2, 2, 30).mean(1) * view.values[0].float().norm(dim=-1)
    assert torch.allclose(ours[0], probs, rtol=1e-3, atol=1e-6)


def test_expected_attention_rejects_bad_parameters():
    with pytest.raises(InvalidParameterError, match="n_future"):
        get_method("expected_attention", n_future=0)
    with pytest.raises(InvalidParameterError, match="n_sink"):
        get_method("expected_attention", n_sink=-1)


# ------------------------------------------------------------------------------------------------ ChunkKV
def test_chunk_selection_keeps_whole_chunks_and_the_window():
    pos = torch.arange(30).view(1, 1, 30).expand(1, 2, 30)
    scores = torch.zeros(1, 2, 30)
    scores[0, 0, 12] = 5.0  # chunk [10, 15) is best for head 0 on a single token
    scores[0, 1, 21:24] = 1.0  # chunk [20, 25) is best for head 1 on average
    budgets = torch.tensor([[15, 15]])
    keep = chunk_keep_mask(pos, scores, budgets, torch.tensor([30]), chunk=5, recent=5, share_heads=False)
    assert set(range(10, 15)) <= set(keep[0, 0].nonzero().flatten().tolist())
    assert set(range(20, 25)) <= set(keep[0, 1].nonzero().flatten().tolist())
    for h in range(2):  # whole chunks: every kept body token's chunk is kept entirely
        kept = set(keep[0, h].nonzero().flatten().tolist())
        assert all({c // 5 * 5 + i for i in range(5)} <= kept for c in kept)
        assert len(kept) == 15
    shared = chunk_keep_mask(pos, scores, budgets, torch.tensor([30]), chunk=5, recent=5, share_heads=True)
    assert torch.equal(shared[0, 0], shared[0, 1])


def test_chunk_selection_never_exceeds_the_budget_and_skips_padding():
    pos = torch.cat([torch.full((1, 1, 3), -1), torch.arange(23).view(1, 1, 23)], dim=-1)  # left padding
    scores = torch.rand(1, 1, 26, generator=torch.Generator().manual_seed(0))
    keep = chunk_keep_mask(pos, scores, torch.tensor([[12]]), torch.tensor([23]), chunk=4, recent=3, share_heads=True)
    assert not keep[0, 0, :3].any() and int(keep.sum()) <= 12 and int(keep.sum()) >= 12 - 3
    assert keep[0, 0, -3:].all()


def test_chunk_index_reuse_shares_the_reference_layer_selection():
    selector = ChunkSelector(chunk=4, recent=2, reuse_layers=2)

    class View:
        def __init__(self, layer, shared):
            self.layer_idx, self.shared = layer, shared
            self.positions = torch.arange(20).view(1, 1, 20)
            self.context_lengths = torch.tensor([20])

    shared: dict = {}
    s0 = torch.zeros(1, 1, 20)
    s0[0, 0, 4:8] = 1.0
    s1 = torch.zeros(1, 1, 20)
    s1[0, 0, 12:16] = 1.0  # layer 1 alone would choose another chunk
    budgets = torch.tensor([[6]])
    a = selector.select(View(0, shared), s0, budgets)
    b = selector.select(View(1, shared), s1, budgets)
    c = selector.select(View(2, shared), s1, budgets)  # a new group: selects on its own
    kept = [sel.indices[sel.keep_mask].tolist() for sel in (a, b, c)]
    assert kept[0] == kept[1] == [4, 5, 6, 7, 18, 19]
    assert kept[2] == [12, 13, 14, 15, 18, 19]
    with pytest.raises(InvalidParameterError, match="chunk"):
        ChunkSelector(chunk=0)


# -------------------------------------------------------------------------------------------------- KVzip
def test_reconstruction_feed_strips_the_prefix_and_left_pads():
    ids = torch.tensor([[-1, -1, 7, 8, 9, 10], [20, 21, 22, 23, 24, 25]])
    feed, mask = reconstruction_feed(ids, torch.tensor([90, 91]), prefix_len=1)
    assert feed.tolist() == [[0, 0, 90, 91, 8, 9, 10], [90, 91, 21, 22, 23, 24, 25]]
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]


def test_kvzip_scores_are_the_max_attention_of_the_reconstruction_queries():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(4))
    scorer = ReconstructionScorer(n_sink=3)
    scorer._model, scorer._repeat_ids = model, torch.tensor([5, 6, 7])  # a fixed instruction, no tokenizer
    pipe = get_method("kvzip", n_sink=3)
    pipe.scorer = scorer
    cache = KVTrimCache(2, pipe, BudgetSpec(budget=10), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert cache.prompt_ids is not None and torch.equal(cache.prompt_ids, ids)
    views = layer_views(cache, torch.tensor([40]))
    with torch.inference_mode():
        scorer.prepare(views)
    full = torch.cat([ids, torch.tensor([[5, 6, 7]]), ids], dim=1)  # prompt, instruction, prompt re-read
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        attn = model(input_ids=full, output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    for layer in range(2):
        ref = attn[layer][0, :, 40:, :40].amax(dim=1).view(2, 2, 40).amax(1)  # max over queries, then group
        ours = scorer.score(views[layer])[0]
        assert torch.allclose(ours[:, 3:], ref[:, 3:], atol=1e-5)
        assert bool((ours[:, :3] == 2.0).all())  # sinks rank first
    assert len(cache.layers[0].store.keys[0, 0]) == 40  # the reconstruction never touched the cache


def test_global_threshold_budget_keeps_the_global_top_entries():
    s0 = torch.tensor([[[0.9, 0.1, 0.8], [0.2, 0.3, float("-inf")]]])  # layer 0, 2 heads
    s1 = torch.tensor([[[0.05, 0.7, 0.6], [0.95, 0.01, 0.02]]])
    req = BudgetRequest(keep=torch.tensor([2]), context_lengths=torch.tensor([3]), num_layers=2, kv_heads=2)
    counts = GlobalThresholdBudget().allocate(req, [s0, s1])
    # top 8 of the 11 finite scores: 0.95 0.9 0.8 0.7 0.6 0.3 0.2 0.1
    assert counts.tolist() == [[[3, 2], [2, 1]]]
