"""A user-given fraction removed per layer (kvpress's PerLayerCompressionPress)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from .base import BudgetAllocator, BudgetRequest


def ratio_keep(context: torch.Tensor, ratio: float) -> torch.Tensor:
    """``[batch]`` entries kept of ``context`` ``[batch]`` tokens at ``ratio`` removed (at least one, kvtrim's
    ``int(T·(1−ratio))`` convention)."""
    kept = torch.floor(context.to(torch.float64) * (1.0 - ratio) + 1e-6).long()
    return torch.minimum(kept.clamp(min=1), context.long())


@dataclass
class LayerRatioBudget(BudgetAllocator):
    """Layer ``l`` keeps ``int(T·(1 − ratios[l]))`` entries per KV head; the request's own ratio or budget is
    not used (kvpress's PerLayerCompressionPress). No ratios: every layer keeps the request.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "layer"

    ratios: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.ratios, (tuple, list)):
            raise InvalidParameterError(f"ratios must be a list of numbers in [0, 1), got {self.ratios!r}")
        for r in self.ratios:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r) or not 0.0 <= r < 1.0:
                raise InvalidParameterError(f"ratios must hold numbers in [0, 1) (fraction removed), got {r!r}")
        self.ratios = tuple(float(r) for r in self.ratios)

    @property
    def keeps_below_request(self) -> bool:
        """Set ratios may evict even when the request keeps the whole context (read by the compressor)."""
        return any(r > 0.0 for r in self.ratios)

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        if not self.ratios:
            return request.keep.view(-1, 1, 1).expand(-1, request.num_layers, request.kv_heads).clone()
        if len(self.ratios) != request.num_layers:
            raise InvalidParameterError(
                f"ratios has {len(self.ratios)} entries but the model has {request.num_layers} layers; give one "
                "fraction removed per layer"
            )
        context = request.context_lengths.to(request.keep.device)
        per_layer = torch.stack([ratio_keep(context, r) for r in self.ratios], dim=1)  # [batch, layers]
        return per_layer[:, :, None].expand(-1, -1, request.kv_heads).clone()
