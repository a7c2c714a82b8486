"""The same budget for every layer and head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BudgetAllocator, BudgetRequest


@dataclass
class UniformBudget(BudgetAllocator):
    """Every (layer, KV head) keeps the requested mean."""

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "none"
    runs_in_vllm = True

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        return request.keep.view(-1, 1, 1).expand(-1, request.num_layers, request.kv_heads).clone()
