"""Error-aware layer budgets (CompressKV, arXiv 2508.02401, Algorithm 1).

Offline, each layer's attention-output error under a small uniform compression is profiled and normalised to a
distribution ``e`` over layers (``Σ e_l = 1``, the ``layer_scores`` of the ``compresskv`` artifact). Online, with
mean budget ``B`` per layer, ``L`` layers, floor ``m`` (32) and ceiling ``M = 3·B``:

1. ``b_l = m + round(e_l · (L·B − L·m))``, clipped to ``[m, M]``;
2. the difference ``Δ = L·B − Σ b_l`` left by rounding and clipping is fixed one entry at a time: for ``Δ > 0``
   cycle through the layers below ``M`` in **descending** ``e_l`` adding 1, for ``Δ < 0`` through the layers
   above ``m`` in **ascending** ``e_l`` removing 1, until ``Δ = 0`` or no layer can move.

Budgets count entries per layer *including* the protected window, and every KV head of a layer gets the
layer's budget. kvtrim adaptations (documented choices): the floor is ``min(m, B)`` so that a mean budget below
32 stays meetable (the layers are then uniform), and the ceiling is ``min(3·B, T)`` for a ``T``-token row, since
a layer cannot keep more entries than the row has (so the total ``L·B`` is always met).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from .base import BudgetAllocator, BudgetRequest
from .head_adaptive import HeadAdaptiveBudget

__all__ = [
    "DEFAULT_MAX_FACTOR",
    "DEFAULT_MIN_BUDGET",
    "ArtifactErrorAwareBudget",
    "ErrorAwareLayerBudget",
    "LayerThenHeadBudget",
    "error_aware_layer_budgets",
]

DEFAULT_MIN_BUDGET = 32
"""``m``: the smallest budget of a layer (CompressKV code)."""
DEFAULT_MAX_FACTOR = 3.0
"""``M = 3·B``: the largest budget of a layer (CompressKV code)."""


def error_aware_layer_budgets(layer_scores: torch.Tensor, total: int, min_budget: int, max_budget: int) -> torch.Tensor:
    """Algorithm 1: integer budgets ``[layers]`` in ``[min_budget, max_budget]`` that sum to ``total`` if they can.

    Args:
        layer_scores: ``[layers]`` non-negative layer errors ``e`` (normalised to sum 1 here)
        total: ``L·B``, the entries to distribute
        min_budget, max_budget: ``m`` and ``M``
    Returns:
        ``[layers]`` long budgets; when ``total`` is outside ``[L·m, L·M]`` the correction stops at the bounds and
        the sum differs from ``total``.
    """
    e = torch.as_tensor(layer_scores, dtype=torch.float64, device="cpu").flatten()
    if e.numel() == 0 or not bool(torch.isfinite(e).all()) or bool((e < 0).any()):
        raise InvalidParameterError("layer_scores must be a non-empty vector of finite, non-negative numbers")
    if min_budget > max_budget:
        raise InvalidParameterError(f"min_budget={min_budget} exceeds max_budget={max_budget}")
    e = e / e.sum() if float(e.sum()) > 0 else torch.full_like(e, 1.0 / e.numel())
    layers = e.numel()
    budgets = (min_budget + torch.round(e * (total - layers * min_budget))).long().clamp(min_budget, max_budget)
    delta = int(total - budgets.sum())
    if delta == 0:
        return budgets
    order = torch.argsort(e, descending=delta > 0, stable=True).tolist()
    while delta != 0:
        moved = False
        for layer in order:
            if delta > 0 and budgets[layer] < max_budget:
                budgets[layer] += 1
                delta -= 1
                moved = True
            elif delta < 0 and budgets[layer] > min_budget:
                budgets[layer] -= 1
                delta += 1
                moved = True
            if delta == 0:
                break
        if not moved:
            break
    return budgets


@dataclass
class ErrorAwareLayerBudget(BudgetAllocator):
    """Per-layer budgets from profiled layer errors (Algorithm 1), the same for every KV head of a layer.

    Args:
        layer_scores: ``[layers]`` normalised layer errors ``e``
        min_budget: ``m`` (32); the floor used is ``min(m, B)``
        max_factor: ``M = max_factor · B`` (3); capped at the row's context length
    Returns from :meth:`allocate`: ``[batch, layers, kv_heads]`` budgets (window included) summing to
    ``layers · kv_heads · keep`` per row.
    """

    layer_scores: torch.Tensor
    min_budget: int = DEFAULT_MIN_BUDGET
    max_factor: float = DEFAULT_MAX_FACTOR
    source: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        scores = torch.as_tensor(self.layer_scores).detach().to("cpu", torch.float64).flatten()
        if scores.numel() == 0 or not bool(torch.isfinite(scores).all()) or bool((scores < 0).any()):
            raise InvalidParameterError("layer_scores must be a non-empty vector of finite, non-negative numbers")
        if isinstance(self.min_budget, bool) or not isinstance(self.min_budget, int) or self.min_budget < 1:
            raise InvalidParameterError(f"min_budget must be a positive integer, got {self.min_budget!r}")
        if not isinstance(self.max_factor, (int, float)) or not self.max_factor >= 1.0:
            raise InvalidParameterError(f"max_factor must be a number >= 1, got {self.max_factor!r}")
        self.layer_scores = scores

    def layer_budgets(self, keep: int, context: int) -> torch.Tensor:
        """``[layers]`` budgets for a row keeping ``keep`` entries per layer on average out of ``context``."""
        layers = self.layer_scores.numel()
        if keep >= context:
            return torch.full((layers,), context, dtype=torch.long, device="cpu")
        low = min(self.min_budget, keep)
        high = max(keep, min(int(self.max_factor * keep), context))
        return error_aware_layer_budgets(self.layer_scores, layers * keep, low, high)

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        layers = self.layer_scores.numel()
        if layers != request.num_layers:
            raise InvalidParameterError(
                f"layer_scores cover {layers} layers but the cache has {request.num_layers}; "
                "use the scores calibrated for this model"
            )
        rows = [
            self.layer_budgets(int(keep), int(context))
            for keep, context in zip(request.keep.tolist(), request.context_lengths.tolist(), strict=True)
        ]
        out = torch.stack(rows)[:, :, None].expand(-1, -1, request.kv_heads).clone()
        return out.to(request.keep.device)


@dataclass
class ArtifactErrorAwareBudget(BudgetAllocator):
    """:class:`ErrorAwareLayerBudget` loaded from the ``layer_scores`` of the model's ``compresskv`` artifact.

    A model with no artifact raises :class:`~kvtrim.errors.MissingArtifactError` naming
    ``kvtrim calibrate compresskv`` at bind time, before anything runs.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "layer"
    artifact_kind = "compresskv"

    min_budget: int = DEFAULT_MIN_BUDGET
    max_factor: float = DEFAULT_MAX_FACTOR
    path: str | None = None
    _inner: ErrorAwareLayerBudget | None = field(default=None, repr=False)

    def bind(self, model: torch.nn.Module) -> None:
        from ..artifacts.compresskv import load_compresskv

        artifact = load_compresskv(model, self.path)
        source = {"artifact": str(artifact.path), "model_key": artifact.meta.get("model_key")}
        self._inner = ErrorAwareLayerBudget(artifact.tensors["layer_scores"], self.min_budget, self.max_factor, source)

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        if self._inner is None:
            raise InvalidParameterError(
                "error-aware layer budgets need the model's compresskv artifact: resolve the method through "
                "kvtrim.generate, kvtrim.Session or kvtrim.compressing, or call pipeline.bind(model) first"
            )
        return self._inner.allocate(request, scores)


@dataclass
class LayerThenHeadBudget(BudgetAllocator):
    """Layer budgets from one allocator, then the KV heads of each layer share their layer's budget (AdaKV).

    Args:
        layers: an allocator whose budgets are the same for every KV head of a layer (e.g.
            :class:`ArtifactErrorAwareBudget`)
        heads: the within-layer split (:class:`HeadAdaptiveBudget`); each layer's total stays ``kv_heads · b_l``
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "head"

    layers: BudgetAllocator
    heads: HeadAdaptiveBudget

    @property
    def artifact_kind(self) -> str | None:
        """The calibration artifact its layer allocator reads; read by the method registry."""
        return getattr(self.layers, "artifact_kind", None)

    def bind(self, model: torch.nn.Module) -> None:
        self.layers.bind(model)

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        if request.positions is None:
            raise InvalidParameterError("LayerThenHeadBudget needs slot positions in the budget request")
        per_layer = self.layers.allocate(request, scores)  # [batch, layers, kv_heads], equal over heads
        out = torch.zeros_like(per_layer)
        for layer, (s, pos) in enumerate(zip(scores, request.positions, strict=True)):
            for row, context in enumerate(request.context_lengths.tolist()):
                keep = int(per_layer[row, layer].max())
                out[row, layer] = self.heads.head_budgets(s[row], pos[row], keep, int(context)).to(out.device)
        return out
