"""Pyramid-shaped layer budgets: lower layers keep more (PyramidKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BudgetRequest


def pyramid_layer_budgets(keep: int, context: int, num_layers: int, window: int, beta: float) -> list[int]:
    """Per-layer budgets (window included) with mean ``keep``, decreasing linearly with depth.

    Follows PyramidKV's schedule: with ``b = keep - window`` selected entries on average,
    ``min = b // beta`` and ``max = 2b - min``; ``max`` is capped at ``context - window`` (``min`` then
    rises to keep the mean); layer ``l`` gets ``max - l·step`` with ``step = (max - min) // (L - 1)``.
    Short contexts (``context < 2b``) and single-layer models fall back to uniform budgets.
    """
    b = keep - window
    if b <= 0 or num_layers == 1 or context < 2 * b:
        return [keep] * num_layers
    min_num = int(b // beta)
    max_num = 2 * b - min_num
    if max_num >= context - window:
        max_num = context - window
        min_num = 2 * b - max_num
    step = (max_num - min_num) // (num_layers - 1)
    return [max_num - layer * step + window for layer in range(num_layers)]


@dataclass
class PyramidBudget:
    """PyramidKV allocation.

    Args:
        beta: ratio between the mean and the smallest layer budget (PyramidKV default 20)
        window: the observation window kept on top of the selected entries
    """

    beta: float = 20.0
    window: int = 32

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        rows = []
        for keep, context in zip(request.keep.tolist(), request.context_lengths.tolist(), strict=True):
            per_layer = pyramid_layer_budgets(keep, context, request.num_layers, self.window, self.beta)
            rows.append([min(b, context) for b in per_layer])
        out = torch.tensor(rows, dtype=torch.long, device=request.keep.device)
        return out[:, :, None].expand(-1, -1, request.kv_heads).clone()
