"""Pyramid-shaped layer budgets: lower layers keep more (PyramidKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BudgetAllocator, BudgetRequest
from .head_adaptive import largest_remainder


def pyramid_layer_budgets(keep: int, context: int, num_layers: int, window: int, beta: float) -> list[int]:
    """Per-layer budgets (window included) with mean exactly ``keep``, decreasing linearly with depth.

    Follows PyramidKV's schedule: with ``b = keep - window`` selected entries on average,
    ``min = b // beta`` and ``max = 2b - min``; ``max`` is capped at ``context - window`` (``min`` then
    rises to keep the mean). Layer ``l`` gets ``max - l·(max - min)/(L - 1)``. KVCache-Factory floors that step,
    which lifts the mean above ``b`` (by up to ``L/2`` entries per layer); here the same line is rounded by largest
    remainder so the total is exactly ``L·keep`` and comparisons at equal ratio are fair. Short contexts
    (``context < 2b``) and single-layer models fall back to uniform budgets.
    """
    b = keep - window
    if b <= 0 or num_layers == 1 or context < 2 * b:
        return [keep] * num_layers
    min_num = int(b // beta)
    max_num = 2 * b - min_num
    if max_num >= context - window:
        max_num = context - window
        min_num = 2 * b - max_num
    line = torch.linspace(float(max_num), float(min_num), num_layers, dtype=torch.float64, device="cpu")
    selected = largest_remainder(line, b * num_layers)
    return [int(x) + window for x in selected.tolist()]


@dataclass
class PyramidBudget(BudgetAllocator):
    """PyramidKV allocation.

    Args:
        beta: ratio between the mean and the smallest layer budget (PyramidKV default 20)
        window: the observation window kept on top of the selected entries
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "layer"
    runs_in_vllm = True  # per-layer counts depend on the prompt length only (kvtrim.vllm: per-layer seq_lens)

    beta: float = 20.0
    window: int = 32

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        rows = []
        for keep, context in zip(request.keep.tolist(), request.context_lengths.tolist(), strict=True):
            per_layer = pyramid_layer_budgets(keep, context, request.num_layers, self.window, self.beta)
            rows.append([min(b, context) for b in per_layer])
        out = torch.tensor(rows, dtype=torch.long, device=request.keep.device)
        return out[:, :, None].expand(-1, -1, request.kv_heads).clone()
