"""KVCompose's composite tokens and global layer allocation (arXiv 2509.05165), and its re-read scores."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model
from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.composite import CompositeLayerBudget, composite_scores
from kvtrim.compression.compressor import BudgetSpec, layer_views
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method
from kvtrim.scoring.reconstruction import _SCORES
from kvtrim.scoring.reread import RereadAttentionScorer

NINF = float("-inf")


def test_a_composite_token_joins_the_same_rank_of_every_head():
    # head 0 ranks slots 0 > 2 > 1, head 1 ranks 1 > 2 > 0: composite r pairs their r-th best entries
    scores = torch.tensor([[[0.9, 0.1, 0.5], [0.2, 0.8, 0.4]]])
    assert composite_scores(scores)[0].tolist() == pytest.approx([0.85, 0.45, 0.15])
    # a head holding fewer entries ends the composite tokens there
    short = torch.tensor([[[0.9, 0.1, 0.5], [0.2, NINF, 0.4]]])
    assert composite_scores(short)[0].tolist()[:2] == pytest.approx([0.65, 0.35])
    assert composite_scores(short)[0, 2].item() == NINF


def _allocate(layers, keep, **params):
    scores = [torch.tensor(layer)[None, None].expand(1, 2, -1) for layer in layers]  # 2 heads with equal scores
    request = BudgetRequest(keep=torch.tensor([keep]), context_lengths=torch.tensor([4]), num_layers=len(layers),
                            kv_heads=2)  # fmt: skip
    return CompositeLayerBudget(**params).allocate(request, scores)[0]


def test_layers_with_informative_tokens_get_more_of_one_global_budget():
    peaked, flat = [0.9, 0.8, 0.01, 0.01], [0.31, 0.3, 0.29, 0.28]
    counts = _allocate([flat, peaked], keep=3, first_layer_max=False)  # 6 composite places over 2 layers
    assert counts.tolist() == [[4, 4], [2, 2]]  # every head of a layer keeps the same number
    assert _allocate([flat, peaked], keep=2, first_layer_max=False).tolist() == [[2, 2], [2, 2]]


def test_every_layer_keeps_the_floor_and_the_first_layer_is_never_squeezed():
    low, high = [0.01, 0.01, 0.01, 0.01], [0.5, 0.4, 0.3, 0.2]
    assert _allocate([low, high], keep=2, first_layer_max=False).tolist() == [[1, 1], [4, 4]]  # floor 1
    # the first layer's composite scores are raised to the largest layer's at each rank: it ties the other
    assert _allocate([low, high], keep=2).tolist() == [[2, 2], [2, 2]]
    assert _allocate([low, high], keep=4).tolist() == [[4, 4], [4, 4]]  # nothing evicted


def test_head_mean_is_added_to_every_head_s_scores():
    scorer = RereadAttentionScorer()
    view = SimpleNamespace(
        layer_idx=0,
        shared={_SCORES: {0: torch.tensor([[[1.0, 0.0], [0.0, 0.5]]])}},
        valid=torch.ones(1, 2, 2, dtype=torch.bool),
    )
    assert torch.allclose(scorer.score(view)[0], torch.tensor([[1.5, 0.25], [0.5, 0.75]]))
    assert RereadAttentionScorer(head_mean=False).score(view)[0].tolist() == [[1.0, 0.0], [0.0, 0.5]]


def test_reread_scores_are_the_max_attention_of_the_prompt_read_again():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(6))
    pipe = get_method("kvcompose", head_mean=False)
    pipe.bind(model)
    cache = KVTrimCache(2, pipe, BudgetSpec(budget=10), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    views = layer_views(cache, torch.tensor([30]))
    with torch.inference_mode():
        pipe.scorer.prepare(views)
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        attn = model(input_ids=torch.cat([ids, ids], dim=1), output_attentions=True).attentions  # no instruction
    model.set_attn_implementation("sdpa")
    for layer in range(2):
        ref = attn[layer][0, :, 30:, :30].amax(dim=1).view(2, 2, 30).amax(1)  # max over queries, then group
        assert torch.allclose(pipe.scorer.score(views[layer])[0], ref, atol=1e-5)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: CompositeLayerBudget(floor=0), "floor"),
        (lambda: CompositeLayerBudget(first_layer_max=1), "first_layer"),
        (lambda: RereadAttentionScorer(head_mean="no"), "head_mean"),
        (lambda: RereadAttentionScorer(prompt="x"), "prompt"),
        (lambda: get_method("kvcompose", structured=None), "structured"),
    ],
)
def test_bad_parameters_are_refused(make, name):
    with pytest.raises(InvalidParameterError, match=name):
        make()
