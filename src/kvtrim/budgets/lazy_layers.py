"""Lazy layers keep only their first and recent tokens, the others everything (SimLayerKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from .base import BudgetAllocator, BudgetRequest


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidParameterError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def lazy_layers(
    scores: list[torch.Tensor], positions: list[torch.Tensor], context: torch.Tensor, n_initial: int, n_recent: int,
    threshold: float,
) -> torch.Tensor:
    """``[batch, layers]`` True where a layer is lazy: the attention its last queries pay to the first
    ``n_initial`` and the last ``n_recent`` tokens, averaged over the KV heads, is above ``threshold``.

    Args:
        scores: per layer ``[batch, kv_heads, seq]`` attention probabilities of the last queries (mean over the
            queries and the heads of a group), ``-inf`` for empty slots
        positions: per layer ``[batch, kv_heads, seq]`` logical positions, ``-1`` for empty slots
        context: ``[batch]`` tokens per row
    """
    lazy = []
    for layer_scores, pos in zip(scores, positions, strict=True):
        ctx = context.to(pos.device)[:, None, None]
        ends = (pos >= 0) & ((pos < n_initial) | (pos >= ctx - n_recent))
        mass = torch.where(ends, layer_scores.to(pos.device), 0.0).sum(-1).mean(-1)  # [batch]
        lazy.append(mass > threshold)
    return torch.stack(lazy, dim=1)


@dataclass
class LazyLayerBudget(BudgetAllocator):
    """A lazy layer keeps its first ``n_initial`` and last ``n_recent`` tokens, every other layer the request
    (Zhang et al., 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction", arXiv 2410.13846).

    The scores must be attention probabilities of the prompt's last queries (a window-attention scorer): a layer
    is lazy in a row when the mass they pay to those two ends, averaged over the KV heads, exceeds ``threshold``.
    Paired with a selector protecting the same ends, a lazy layer keeps exactly them. The request caps every
    layer: ``ratio=0`` gives the paper's method (non-lazy layers keep the whole context).
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "layer"

    threshold: float = 0.9
    n_initial: int = 4
    n_recent: int = 1024

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise InvalidParameterError(f"threshold must be a number in [0, 1] (attention mass), got {t!r}")
        self.threshold = float(t)
        _count(self.n_initial, "n_initial")
        _count(self.n_recent, "n_recent")

    @property
    def keeps_below_request(self) -> bool:
        """Lazy layers evict even when the request keeps the whole context (read by the compressor); the mass
        never exceeds 1, so a threshold of 1 marks no layer lazy."""
        return self.threshold < 1.0

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        if request.positions is None:
            raise RuntimeError("LazyLayerBudget needs the stored positions in the budget request")
        context = request.context_lengths
        lazy = lazy_layers(scores, request.positions, context, self.n_initial, self.n_recent, self.threshold)
        keep = request.keep.to(lazy.device)[:, None]
        ends = torch.clamp(context.to(lazy.device), max=self.n_initial + self.n_recent)[:, None]
        per_layer = torch.where(lazy, torch.minimum(ends, keep), keep)  # [batch, layers]
        return per_layer[:, :, None].expand(-1, -1, request.kv_heads).clone().to(request.keep.device)
