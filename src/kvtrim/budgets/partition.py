"""Budgets of a recursive partition method (LagKV): a fixed share of every partition compressed now."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from ..scoring.partitions import partition_layout
from .base import BudgetAllocator, BudgetRequest


def keep_per_partition(ratio: float, lag: int) -> int:
    """``⌊r·L⌋`` with ``r = 1 − ratio`` (``k×`` compression ↔ ratio ``1 − 1/k``)."""
    return math.floor(round((1.0 - ratio) * lag, 6))


@dataclass
class PartitionBudget(BudgetAllocator):
    """Each (row, layer, KV head) keeps everything outside the partitions compressed now, plus ``⌊r·L⌋`` of each
    of them. Needs a ratio (the keep fraction ``r = 1 − ratio`` applies per partition); ``skip_layers`` keep all.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "none"
    runs_in_vllm = True

    sink: int = 16
    lag: int = 128
    skip_layers: tuple[int, ...] = ()

    def check(self, ratio: float | None, budget: int | None) -> None:
        if ratio is None:
            raise InvalidParameterError(
                "this method takes ratio (fraction removed per lag partition, in [0, 1)), not budget"
            )

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        self.check(request.ratio, None)
        k = keep_per_partition(float(request.ratio), self.lag)
        out = []
        for layer, positions in enumerate(request.positions):
            held = (positions >= 0).sum(-1)  # [batch, kv_heads]
            if layer in self.skip_layers:
                out.append(held)
                continue
            done = None if request.compressed_until is None else request.compressed_until[layer]
            layout = partition_layout(positions, request.context_lengths, done, self.sink, self.lag)
            removed = (layout.compress * (self.lag - k)).view(-1, 1)
            out.append(held - removed)
        return torch.stack(out, dim=1)
