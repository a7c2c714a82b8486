"""One score threshold across all layers and KV heads: each (layer, head) keeps its entries above it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BudgetAllocator, BudgetRequest


@dataclass
class GlobalThresholdBudget(BudgetAllocator):
    """Token-granular global allocation (KVzip's non-layerwise mode, Kim et al., arXiv 2505.23416).

    Per row, the ``keep · layers · kv_heads`` highest scores over the whole cache are kept; a (layer, KV head)
    keeps as many entries as it holds among them, so the mean per head is the requested budget and rates vary
    freely. Scores must be comparable across layers and heads (KVzip's attention maxima are probabilities).
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "head"

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        b, layers, heads = len(request.keep), request.num_layers, request.kv_heads
        width = max(s.shape[-1] for s in scores)
        padded = [torch.nn.functional.pad(s.float(), (0, width - s.shape[-1]), value=float("-inf")) for s in scores]
        flat = torch.stack(padded, dim=1).reshape(b, -1)  # [b, layers * heads * width]
        total = request.keep.to(flat.device) * (layers * heads)
        top = flat.topk(int(total.max()), dim=-1)
        chosen = (torch.arange(top.indices.shape[-1], device=flat.device) < total[:, None]) & torch.isfinite(top.values)
        owner = top.indices // width  # layer * heads + head
        counts = torch.zeros(b, layers * heads, dtype=torch.long, device=flat.device)
        counts.scatter_add_(1, owner, chosen.long())
        return counts.view(b, layers, heads).to(request.keep.device)
