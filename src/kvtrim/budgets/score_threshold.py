"""Budgets set by a score threshold: each (layer, KV head) keeps its entries scoring at least τ (DMS)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from .base import BudgetAllocator, BudgetRequest


@dataclass
class ScoreThresholdBudget(BudgetAllocator):
    """Keep the entries whose score is at least ``threshold``, plus the last ``recent`` positions, capped at the
    requested budget (Dynamic Memory Sparsification's eviction rule, Łańcucki et al., 2025, "Inference-Time
    Hyper-Scaling with KV Cache Compression", arXiv 2506.05345).

    The count of a (row, layer, KV head) is the number of its stored entries with ``score ≥ threshold`` or a
    position among the last ``recent`` tokens, at most ``keep`` (the user's ratio or budget: ``ratio=0`` leaves
    only the threshold). Paired with a selector that protects the same ``recent`` window, the kept entries are
    exactly the window plus the entries at or above the threshold (the best of them when the cap binds).
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "head"

    threshold: float = -math.inf
    recent: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or math.isnan(
            self.threshold
        ):
            raise InvalidParameterError(f"threshold must be a number (or -inf), got {self.threshold!r}")
        if isinstance(self.recent, bool) or not isinstance(self.recent, int) or self.recent < 0:
            raise InvalidParameterError(f"recent must be an integer >= 0, got {self.recent!r}")

    @property
    def keeps_below_request(self) -> bool:
        """A finite threshold evicts even when the request keeps the whole context (read by the compressor)."""
        return self.threshold > -math.inf

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        if request.positions is None:
            raise RuntimeError("ScoreThresholdBudget needs the stored positions in the budget request")
        counts = []
        for layer_scores, positions in zip(scores, request.positions, strict=True):
            context = request.context_lengths.to(positions.device)[:, None, None]
            window = positions >= context - self.recent
            kept = (positions >= 0) & ((layer_scores.to(positions.device) >= self.threshold) | window)
            counts.append(kept.sum(-1))  # [batch, kv_heads]
        counts = torch.stack(counts, dim=1)  # [batch, layers, kv_heads]
        keep = request.keep.to(counts.device).view(-1, 1, 1)
        return torch.minimum(counts, keep).to(request.keep.device)
