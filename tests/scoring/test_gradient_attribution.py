"""KVgrad (kvpress KVgradPress): KVzip's reconstruction attention × ‖v·W_O‖ × the gradient norm of Φ = Σ‖h‖²."""

from __future__ import annotations

import torch

from conftest import tiny_model
from kvtrim.compression.compressor import BudgetSpec, layer_views
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method
from kvtrim.scoring.gradient_attribution import (
    GradientAttributionScorer,
    attributed_attention,
    value_output_norms,
)

# One KV head, two query heads; queries of zeros attend uniformly: the query at position 1 pays 1/2 to keys 0, 1,
# the one at position 2 pays 1/3 to keys 0, 1, 2.
QUERIES = torch.zeros(1, 2, 2, 4)
QPOS = torch.tensor([[1, 2]])
KEYS = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(0))
KPOS = torch.tensor([[[0, 1, 2]]])
VNORM = torch.tensor([[[[1.0, 2.0, 6.0], [2.0, 1.0, 0.0]]]])  # ‖v_c W_O[h]‖ for the two query heads


def _scores(gradients):
    return attributed_attention(QUERIES, QPOS, KEYS, KPOS, 1.0, torch.tensor([gradients]), VNORM, 3)[0, 0]


def test_an_entry_scores_its_largest_attention_times_value_norm_times_gradient_norm():
    # c0: max(1/2·3·1, 1/2·3·2, 1/3·1·1, 1/3·1·2) = 3; c1: 1/2·3·2 = 3; c2: 1/3·1·6 = 2
    assert torch.allclose(_scores([3.0, 1.0]), torch.tensor([3.0, 3.0, 2.0]))
    # a query the objective does not depend on adds nothing: only the query at position 2 counts
    assert torch.allclose(_scores([0.0, 1.0]), torch.tensor([2 / 3, 2 / 3, 2.0]))


def test_value_output_norms_are_the_l2_norms_of_each_query_head_s_projection():
    g = torch.Generator().manual_seed(1)
    values, w = torch.randn(2, 2, 5, 4, generator=g), torch.randn(8, 4 * 4, generator=g)  # 4 query heads, 2 KV
    out = value_output_norms(values, w)
    for h in range(4):
        ref = (values[:, h // 2] @ w[:, h * 4 : (h + 1) * 4].T).norm(dim=-1)
        assert torch.allclose(out[:, h // 2, h % 2], ref, atol=1e-5)


def test_scores_match_autograd_through_transformers_eager_attention():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(4))
    scorer = GradientAttributionScorer(n_sink=3)
    scorer._model, scorer._repeat_ids = model, torch.tensor([5, 6, 7])  # a fixed instruction, no tokenizer
    pipe = get_method("kvgrad", n_sink=3)
    pipe.scorer = scorer
    cache = KVTrimCache(2, pipe, BudgetSpec(budget=10), auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    views = layer_views(cache, torch.tensor([30]))
    with torch.inference_mode():
        scorer.prepare(views)
    # Brute force: prompt, instruction and prompt again as one sequence through eager attention, differentiated.
    full = torch.cat([ids, torch.tensor([[5, 6, 7]]), ids], dim=1)
    model.set_attn_implementation("eager")
    outputs, weights = {}, {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        def keep(module, args, out, i=i):
            outputs[i], weights[i] = out
        hooks.append(layer.self_attn.register_forward_hook(keep))
    last = {}
    hooks.append(model.model.norm.register_forward_pre_hook(lambda m, a: last.update(h=a[0])))
    embeds = model.model.embed_tokens(full).detach().requires_grad_(True)
    model(inputs_embeds=embeds, output_attentions=True)
    for hook in hooks:
        hook.remove()
    model.set_attn_implementation("sdpa")
    phi = last["h"][0, 30:].float().square().sum()
    grads = torch.autograd.grad(phi, [outputs[0], outputs[1]])
    for layer in range(2):
        g = grads[layer][0, 30:].norm(dim=-1)  # [33] reconstruction tokens
        attn = weights[layer][0, :, 30:, :30].detach()  # [4 heads, 33, 30]
        with torch.no_grad():
            vnorm = value_output_norms(views[layer].values, model.model.layers[layer].self_attn.o_proj.weight)[0]
        ref = (attn * g[None, :, None]).view(2, 2, 33, 30) * vnorm[:, :, None, :]
        ref = ref.amax(dim=(1, 2))  # [kv heads, 30]
        ours = scorer.score(views[layer])[0]
        assert torch.allclose(ours[:, 3:], ref[:, 3:], rtol=1e-4, atol=1e-6)
        assert bool((ours[:, :3] == torch.finfo(torch.float32).max).all())  # sinks rank first
    assert len(cache.layers[0].store.keys[0, 0]) == 30  # the reconstruction never touched the cache
