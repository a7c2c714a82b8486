"""Scores from input × gradient attribution over KVzip's context reconstruction (KVgrad): one forward and one
backward pass at compression time."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..cache.attention import attention_probabilities
from ..errors import UnsupportedModelError
from .base import LayerView
from .observation import ObservationSpec
from .reconstruction import ReconstructionScorer, reconstruction_feed

_SCORES = "kvgrad_scores"
_SINK_SCORE = torch.finfo(torch.float32).max  # sinks are never evicted, whatever the budget allocator does
_QUERIES = 1 << 24  # attention probabilities per chunk of reconstruction queries (64 MiB in fp32)


def value_output_norms(values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """``‖v · W_O[h]‖₂`` of every value for every query head ``h`` of its group.

    Args:
        values: ``[batch, kv_heads, seq, head_dim]``
        o_proj_weight: ``[hidden, q_heads * head_dim]`` (``nn.Linear`` layout)
    Returns:
        ``[batch, kv_heads, group, seq]`` fp32
    """
    hkv, d = values.shape[1], values.shape[-1]
    hidden = o_proj_weight.shape[0]
    group = o_proj_weight.shape[1] // d // hkv
    w = o_proj_weight.float().view(hidden, hkv, group, d)
    # ‖v W‖² = v (WᵀW) v: one [d, d] Gram matrix per query head instead of a [seq, hidden] projection
    gram = torch.einsum("ekgd,ekgf->kgdf", w, w)
    v = values.float()
    return torch.einsum("bksd,kgdf,bksf->bkgs", v, gram, v).clamp(min=0).sqrt()


def attributed_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    gradient_norms: torch.Tensor,
    value_norms: torch.Tensor,
    scored: int,
) -> torch.Tensor:
    """``max over p and the group of A[h, p, c] · ‖v_c W_O[h]‖ · g_p`` for the first ``scored`` slots.

    Args:
        queries: ``[batch, q_heads, w, d]`` post-rotary reconstruction queries; ``query_positions`` ``[batch, w]``
            (``-1``: padding)
        keys: ``[batch, kv_heads, n, d]`` every slot the queries saw (the cache, then the reconstruction's own);
            ``key_positions`` ``[batch, kv_heads, n]``
        gradient_norms: ``[batch, w]`` ``‖∂Φ/∂a_p‖`` of each query's attention output
        value_norms: ``[batch, kv_heads, group, scored]`` from :func:`value_output_norms`
    Returns:
        ``[batch, kv_heads, scored]`` fp32
    """
    b, hq, w, _ = queries.shape
    hkv = keys.shape[1]
    best = torch.zeros(b, hkv, scored, dtype=torch.float32, device=keys.device)
    chunk = max(1, _QUERIES // max(1, b * hq * keys.shape[2]))
    for start in range(0, w, chunk):
        q, qpos = queries[:, :, start : start + chunk], query_positions[:, start : start + chunk]
        mask = (key_positions[:, :, None, :] >= 0) & (key_positions[:, :, None, :] <= qpos[:, None, :, None])
        mask = mask & (qpos >= 0)[:, None, :, None]
        probs = attention_probabilities(q, keys, mask, scaling)[..., :scored]  # [b, hq, c, scored]
        probs = probs.view(b, hkv, hq // hkv, q.shape[2], scored)
        weighted = probs * gradient_norms[:, None, None, start : start + chunk, None] * value_norms[:, :, :, None]
        best = torch.maximum(best, weighted.amax(dim=(2, 3)))
    return best


def _decoder_output_module(model) -> torch.nn.Module:
    """The module whose input is the last decoder layer's output (the final norm)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise UnsupportedModelError("kvgrad needs the model's final norm (model.get_decoder().norm) to read Φ")
    return norm


@dataclass
class GradientAttributionScorer(ReconstructionScorer):
    """KVgrad (kvpress KVgradPress; "KVgrad", https://openreview.net/forum?id=cg1wTCJjjk): KVzip's reconstruction
    (Kim et al., arXiv 2505.23416) with each attention weight attributed by input × gradient.

    The model re-reads its context after the repeat instruction on top of the uncompressed cache, as for KVzip,
    but with an autograd graph. ``Φ = Σ_p ‖h_p‖²`` over the reconstruction tokens ``p`` (``h``: the last decoder
    layer's output, before the final norm) is differentiated with respect to every layer's attention output
    ``a_p`` (what the layer writes into the residual stream). Entry ``c`` of a KV head scores
    ``max over p and the query heads h of its group of A[h, p, c] · ‖v_c W_O[h]‖₂ · ‖∂Φ/∂a_p‖₂``: how much it
    adds to the residual stream of a reconstruction token, times how much the final hidden states depend on that
    stream. The first ``n_sink`` tokens always score highest.

    Cost: KVzip's pass plus a backward pass through it (about 3× the prefill), and the graph of the pass held
    until the backward (activations of every layer for the whole prompt); gradients are taken with respect to the
    activations only, never the weights.
    """

    method_label: ClassVar[str] = "kvgrad"

    def prepare(self, views: list[LayerView]) -> None:
        """Run the reconstruction with a graph, differentiate Φ, score every layer into ``views[0].shared``."""
        if self._model is None:
            raise RuntimeError("kvgrad needs the model: build the cache with kvtrim (generate, Session, make_cache)")
        first = views[0]
        if first.prompt_ids is None or first.replay is None:
            raise RuntimeError(
                "kvgrad re-reads the prompt through a KVTrimCache and needs its token ids, recorded during prefill "
                "when kvtrim attention is enabled (ObservationSpec(input_ids=True))"
            )
        model = self._model
        device = first.keys.device
        with torch.inference_mode(False):  # normal tensors: the graph may save them for the backward pass
            prompt_ids = first.prompt_ids.to(device).clone()
            ids, mask = reconstruction_feed(prompt_ids, self._repeat_ids.to(device), self._prefix_len)
            full_mask = torch.cat([(prompt_ids >= 0).long(), mask], dim=1)
            position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        outputs: dict[int, torch.Tensor] = {}
        captured: dict[str, torch.Tensor] = {}
        index = {id(view.module): view.layer_idx for view in views}

        def leaf(module, args, output):  # the embeddings: a leaf of the graph whatever the weights require
            return output.detach().requires_grad_(True)

        def attention_output(module, args, output):
            outputs[index[id(module)]] = output[0] if isinstance(output, tuple) else output

        def final(module, args):
            captured["h"] = args[0]

        hooks = [model.get_input_embeddings().register_forward_hook(leaf)]
        hooks += [view.module.register_forward_hook(attention_output) for view in views]
        hooks.append(_decoder_output_module(model).register_forward_pre_hook(final))
        observations: dict = {}
        try:
            with torch.inference_mode(False):
                scratch = [
                    dataclasses.replace(v, keys=v.keys.clone(), values=v.values.clone(), positions=v.positions.clone())
                    for v in views
                ]
                spec = ObservationSpec(window=ids.shape[1])
                stores = first.replay(model, scratch, ids, full_mask, position_ids, spec, grad=True,
                                      observations=observations)  # fmt: skip
                with torch.enable_grad():
                    h = captured["h"].float() * mask[..., None]
                    phi = h.square().sum()
                    layers = sorted(outputs)
                    grads = torch.autograd.grad(phi, [outputs[i] for i in layers], allow_unused=True)
        finally:
            for hook in hooks:
                hook.remove()
        norms = {
            i: (torch.zeros(ids.shape, device=device) if g is None else g.detach().float().norm(dim=-1) * mask)
            for i, g in zip(layers, grads, strict=True)
        }
        scores = {}
        with torch.no_grad():
            for view in views:
                obs, store = observations[view.layer_idx], stores[view.layer_idx]
                n = view.keys.shape[2]
                vnorm = value_output_norms(view.values, view.module.o_proj.weight)
                s = attributed_attention(
                    obs.queries.detach(), obs.positions, store.keys.detach(), store.positions, view.scaling,
                    norms[view.layer_idx], vnorm, n,
                )  # fmt: skip
                scores[view.layer_idx] = s.masked_fill(view.valid & (view.positions < self.n_sink), _SINK_SCORE)
        first.shared.update(
            {
                _SCORES: scores,
                "kvzip_repeat_tokens": int(self._repeat_ids.numel()),
                "kvzip_reread_tokens": int(mask.sum(-1).max()) - int(self._repeat_ids.numel()),
            }
        )

    def score(self, view: LayerView) -> torch.Tensor:
        return view.shared[_SCORES][view.layer_idx]
