"""Every (layer, KV head) keeps its whole context: for methods that compress something other than tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BudgetAllocator, BudgetRequest


@dataclass
class KeepAllBudget(BudgetAllocator):
    """Budget = the row's context length for every layer and KV head (no token is evicted); used by ``think``,
    whose ratio is a fraction of key channels."""

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "none"

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        """Returns ``[batch, layers, kv_heads]``."""
        return request.context_lengths.view(-1, 1, 1).expand(-1, request.num_layers, request.kv_heads).clone()
